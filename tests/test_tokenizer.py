"""Tokenizers against llama.cpp: its tokenizer test vectors, llama-tokenize on WikiText-2, the CLI.

tests/data/vocab/ holds llama.cpp's ggml-vocab-*.gguf test vocabularies with their .inp/.out
vectors: a few whole, the others as slim gzipped copies written by bench/check_tokenizers.py
--write-fixtures (every id kept; only the token texts and merges that the vectors and mixed.txt
use), on which llama-tokenize gives the same ids for these texts as on the full files.
mixed.ids.json.gz holds llama-tokenize's ids of mixed.txt for each vocabulary.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT
from typer.testing import CliRunner

from llmtune.cli import app
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue, load_gguf, write_gguf
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.bpe import PRE_TOKENIZERS, RegexSplitter
from llmtune.tokenizer.unicode_data import category

DATA = Path(__file__).parent / "data"
VOCAB_DIR = DATA / "vocab"
VOCABS = sorted([*VOCAB_DIR.glob("ggml-vocab-*.gguf"), *VOCAB_DIR.glob("ggml-vocab-*.gguf.gz")])
STORIES = DATA / "stories260K.gguf"
_UNZIPPED = tempfile.TemporaryDirectory(prefix="llmtune-vocab-")


def vocab_name(path: Path) -> str:
    return path.name[len("ggml-vocab-") :].split(".gguf")[0]


@lru_cache(maxsize=None)
def plain_gguf(path: Path) -> Path:
    """`path` itself, or for a .gguf.gz its gunzipped copy in a temporary folder."""
    if path.suffix != ".gz":
        return path
    out = Path(_UNZIPPED.name) / path.name[: -len(".gz")]
    out.write_bytes(gzip.decompress(path.read_bytes()))
    return out


@lru_cache(maxsize=None)
def tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(load_gguf(plain_gguf(path)))


@lru_cache(maxsize=None)
def metadata(path: Path) -> dict:
    return load_gguf(plain_gguf(path)).metadata


def vocab(name: str) -> Tokenizer:
    return tokenizer(next(p for p in VOCABS if vocab_name(p) == name))


def read_vocab_tests(gguf_path: Path, folder: Path = VOCAB_DIR) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs exactly as llama.cpp's tests/test-tokenizer-0 reads them.

    Texts are the raw bytes of `.inp` split on "\\n__ggml_vocab_test__\\n" (a final separator
    ends the list, it does not open an empty text); `.out` has one line per text, stripped,
    ids separated by spaces.
    """
    gguf_path = folder / f"ggml-vocab-{vocab_name(gguf_path)}.gguf"  # (vectors of a .gguf.gz too)
    raw = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = Path(f"{gguf_path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{gguf_path.name}: {len(texts)} texts but {len(lines)} expected id lines"
    return [(text, [int(x) for x in line.strip().split(" ") if x]) for text, line in zip(texts, lines)]


# -- llama.cpp's test vectors ----------------------------------------------------------------------


def test_vocab_fixtures_cover_every_llama_cpp_vocab_with_vectors():
    names = {vocab_name(p) for p in VOCABS}
    assert names == {
        "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
        "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
    }  # fmt: skip
    assert {vocab(n).kind for n in names} == {"spm", "bpe", "wpm"}
    assert sum(p.stat().st_size for p in VOCAB_DIR.glob("*.gz")) < 400_000  # the slim copies stay small


@pytest.mark.parametrize("path", VOCABS, ids=vocab_name)
def test_llama_cpp_vocab_vectors(path: Path):
    """test-tokenizer-0 tokenizes with add_special=false, parse_special=false."""
    tok = tokenizer(path)
    cases = read_vocab_tests(path)
    assert len(cases) >= 46
    failures = [
        (text, expected, got)
        for text, expected in cases
        if (got := tok.encode(text, add_special=False, parse_special=False)) != expected
    ]
    assert not failures, "\n".join(f"{t!r}: expected {e}, got {g}" for t, e, g in failures[:5])


@lru_cache(maxsize=None)
def mixed_text_ids() -> dict[str, list[int]]:
    return json.loads(gzip.decompress((VOCAB_DIR / "mixed.ids.json.gz").read_bytes()))


@pytest.mark.parametrize("path", VOCABS, ids=vocab_name)
def test_mixed_text_like_llama_tokenize(path: Path):
    """mixed.txt (many scripts, code, emoji, odd whitespace, special-token strings) as
    `llama-tokenize --ids --no-escape` gives it: BOS as the vocabulary asks, specials parsed."""
    tok = tokenizer(path)
    text = (VOCAB_DIR / "mixed.txt").read_bytes().decode("utf-8")  # (bytes: keep its \r\n)
    expected = mixed_text_ids()[vocab_name(path)]
    ids = tok.encode(text, add_special=tok.add_bos, parse_special=True)
    first = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
    assert ids == expected, f"first difference at token {first} of {len(expected)}"


def test_unicode_classes_are_llama_cpp_s_not_python_s():
    # U+1C89 (a Cyrillic capital, Unicode 16.0) is unassigned in llama.cpp's Unicode 15.1 table:
    # not a letter, so GPT-2's pre-tokenizer cuts the word around it (Python's `regex` would not)
    assert (category(0x1C89), category(0x0416), category(0x0301), category(0x3000)) == ("U", "L", "M", "Z")
    gpt2 = RegexSplitter(PRE_TOKENIZERS["gpt-2"].patterns)
    assert gpt2("a\u1c89b \u0416\u0416") == ["a", "\u1c89", "b", " \u0416\u0416"]
    qwen35 = RegexSplitter(PRE_TOKENIZERS["qwen35"].patterns)  # marks join letter runs there only
    assert qwen35("e\u0301e\u0301 x") == ["e\u0301e\u0301", " x"]
    qwen2 = RegexSplitter(PRE_TOKENIZERS["qwen2"].patterns)  # a mark is only an optional lead-in
    assert qwen2("e\u0301e\u0301 x") == ["e", "\u0301e", "\u0301", " x"]


def test_gemma4_is_spm_style_bpe():
    tok = vocab("gemma-4")  # tokenizer.ggml.model "gemma4": BPE over "▁"-escaped UTF-8, BOS always
    assert (tok.kind, tok.pre, tok.add_bos, tok.bos_id) == ("bpe", "gemma4", True, 2)
    ids = tok.encode("Hello world\n\n", add_special=False)
    assert [tok.tokens[i] for i in ids] == ["Hello", "▁world", "\n\n"]
    assert tok.decode(ids) == "Hello world\n\n"
    gemma4 = next(p for p in VOCABS if vocab_name(p) == "gemma-4")
    md = dict(metadata(gemma4), **{"tokenizer.ggml.add_bos_token": False})
    assert Tokenizer.from_metadata(md).encode("Hello")[0] == 2  # llama.cpp overrides add_bos for Gemma 4
    # lines are cut before "▁" where no merge can cross: same ids as merging whole lines
    text = (VOCAB_DIR / "mixed.txt").read_bytes().decode("utf-8")
    whole = Tokenizer.from_metadata(md)
    whole._encoder._chunk = None
    assert tok.encode(text) == whole.encode(text)


def test_wordpiece_normalizes_and_brackets_with_cls_sep():
    tok = vocab("bert-bge")
    assert tok.kind == "wpm" and (tok.bos_id, tok.unk_id) == (101, 100)
    ids = tok.encode("Héllo, WORLD!", add_special=True)
    assert [tok.tokens[i] for i in ids] == ["[CLS]", "▁hello", "▁,", "▁world", "▁!", "[SEP]"]


# -- WikiText-2 with stories260K vs llama-tokenize ------------------------------------------------


def test_wikitext_matches_llama_tokenize():
    text = gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()).decode("utf-8")
    expected = np.load(DATA / "wikitext-2-raw-test.stories260K.ids.npz")["ids"]
    ids = tokenizer(STORIES).encode(text, add_special=True)
    assert len(ids) == len(expected) == 826_675
    mismatch = np.flatnonzero(np.asarray(ids) != expected)
    assert mismatch.size == 0, f"first difference at token {mismatch[0]}"


def test_chunked_spm_equals_whole_text_algorithm():
    text = gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()).decode("utf-8")[:60_000]
    for tok in (tokenizer(STORIES), vocab("llama-spm")):
        escaped = "\u2581" + text.replace(" ", "\u2581")
        assert tok._encoder.encode(escaped) == tok._encoder.encode_whole(escaped)


@pytest.mark.parametrize("name", ["stories260K", "llama-spm", "llama-bpe", "gpt-2", "qwen2", "deepseek-coder",
                                  "starcoder", "falcon", "gemma-4", "bert-bge"])
def test_first_tokens_only_are_the_whole_texts_first(name, monkeypatch):
    """encode(max_tokens=n): SPM and BPE tokenizers stop early (perplexity over --chunks of a long
    file), with the whole text's first ids, at least n of them; WordPiece encodes everything.
    The text mixes WikiText-2 with runs of spaces, newlines and digits and the vocabulary tests'
    texts, so prefix cuts land inside pieces whose pre-tokenizer patterns look ahead."""
    wiki = gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()).decode("utf-8")[:60_000]
    tricky = "".join(t for t, _ in read_vocab_tests(next(p for p in VOCABS if vocab_name(p) == "llama-bpe")))
    text = "".join(f"{wiki[i:i + 3000]}  \n\n   {i} 12345678   \t\n{tricky}" for i in range(0, 60_000, 3000))
    tok = tokenizer(STORIES) if name == "stories260K" else vocab(name)
    whole = tok.encode(text, add_special=True)
    for n in (1, 7, 1000, 5000):
        head = tok.encode(text, add_special=True, max_tokens=n)
        assert len(head) >= n and head == whole[:len(head)], n
        if tok.kind != "wpm":
            assert len(head) < n + 300  # stopped near n, not at the end
        else:
            assert head == whole
    assert tok.encode(text, add_special=True, max_tokens=len(whole) + 10) == whole
    if tok.kind == "bpe":  # prefixes far too short at first: doubled until they hold enough ids
        monkeypatch.setattr(tok._encoder, "_CHARS_PER_ID", 0)
        monkeypatch.setattr(tok._encoder, "_CUT_MARGIN", 16)
        for n in (1, 999, 5000):
            head = tok.encode(text, add_special=True, max_tokens=n)
            assert n <= len(head) < n + 300 and head == whole[:len(head)], n


def tiny_spm(tokens: list[str], scores: list[float]) -> Tokenizer:
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    all_tokens = ["<unk>", "<s>", "</s>", *bytes_, *tokens]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": all_tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(tokens),
    }
    return Tokenizer.from_metadata(md, source="tiny.gguf")


def test_spm_never_cuts_inside_a_piece_that_spans_a_space():
    # "x▁y" is a piece, so the chunker must not cut before that "▁"; it may still cut elsewhere
    tok = tiny_spm(["▁", "x", "y", "z", "x▁", "x▁y", "▁z", "zx"], [-1, -2, -3, -4, -0.5, -0.1, -0.2, -0.3])
    text = "zx y z x y zx yy z"
    ids = tok.encode(text, add_special=False)
    pieces = [tok.tokens[i] for i in ids]
    assert "x▁y" in pieces
    escaped = "\u2581" + text.replace(" ", "\u2581")
    assert ids == tok._encoder.encode_whole(escaped)


def test_spm_merges_by_score_ties_to_the_left():
    # "aaa": both pairs are "aa" with the same score; llama.cpp merges the leftmost first
    tok = tiny_spm(["▁", "a", "aa", "▁a"], [-5, -5, -1, -9])
    assert [tok.tokens[i] for i in tok._encoder.encode_whole("aaa")] == ["aa", "a"]
    assert [tok.tokens[i] for i in tok.encode("aaa", add_special=False)] == ["▁", "aa", "a"]  # "aa" beats "▁a"


def test_spm_byte_fallback_for_unknown_characters():
    tok = tokenizer(STORIES)
    ids = tok.encode("☃", add_special=False)  # U+2603 is no piece: its three UTF-8 bytes
    assert [tok.tokens[i] for i in ids[-3:]] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert tok.decode(ids) == "☃"


# -- flags, special tokens ------------------------------------------------------------------------------


def test_spm_defaults_when_keys_are_missing():
    md = {k: v for k, v in metadata(STORIES).items() if "add_" not in k}
    tok = Tokenizer.from_metadata(md, source="stories")
    assert (tok.kind, tok.add_bos, tok.add_eos, tok.add_space_prefix) == ("spm", True, False, True)
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id, tok.n_vocab) == (1, 2, 0, None, 512)
    assert tok.encode("Once", add_special=True)[0] == 1


def test_metadata_flags_override_defaults():
    md = dict(metadata(STORIES), **{"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_bos_token": False})
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("Once upon", add_special=True)
    assert ids[0] != tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("Once upon", add_special=False) == ids[:-1]
    no_prefix = Tokenizer.from_metadata(dict(metadata(STORIES), **{"tokenizer.ggml.add_space_prefix": False}))
    assert no_prefix.token_to_piece(no_prefix.encode("Once", add_special=False)[0]) == "O"


def test_bpe_properties():
    tok = vocab("gpt-2")
    assert (tok.kind, tok.pre, tok.n_vocab, tok.bos_id, tok.eos_id) == ("bpe", "gpt-2", 50257, 50256, 50256)
    assert (tok.add_bos, tok.add_eos) == (False, False)
    assert vocab("deepseek-coder").add_bos  # from tokenizer.ggml.add_bos_token


def test_parse_special_splits_control_tokens_and_prefixes_the_next_fragment():
    tok = vocab("llama-spm")
    plain = tok.encode("Hello", add_special=False)
    parsed = tok.encode("<s>Hello</s>", add_special=False, parse_special=True)
    assert parsed == [tok.bos_id, *plain, tok.eos_id]  # text after a special token gets the ▁ prefix
    as_text = tok.encode("<s>Hello", add_special=False, parse_special=False)
    assert tok.bos_id not in as_text and tok.decode(as_text) == "<s>Hello"


def test_user_defined_tokens_split_even_without_parse_special():
    tok = vocab("deepseek-coder")  # single characters such as "ö" are user-defined tokens there
    ids = tok.encode("schön", add_special=False, parse_special=False)
    assert tok.tokens.index("ö") in ids
    assert tok.decode(ids) == "schön"


def test_rstrip_tokens_swallow_following_spaces():
    tok = vocab("phi-3")  # llama.cpp marks phi-3's special tokens RSTRIP
    user = tok.tokens.index("<|user|>")
    assert (tok.encode("<|user|>   Hi", add_special=False, parse_special=True)
            == [user, *tok.encode("Hi", add_special=False)])
    # <s> is exempt: its following spaces stay (and get the ▁ prefix)
    assert (tok.encode("<s> Hi", add_special=False, parse_special=True)
            == [tok.bos_id, *tok.encode(" Hi", add_special=False)])


# -- decoding ------------------------------------------------------------------------------------------

ROUND_TRIP_TEXTS = ["Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
                    "Äpfel 🦙 нещо 我想在apple工作", "3333 x"]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "deepseek-coder", "starcoder", "gpt-2", "falcon",
                                  "gemma-4", "qwen35", "deepseek-llm", "llama-bpe", "command-r"])  # fmt: skip
def test_decode_round_trip(name):
    tok = vocab(name)
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text, add_special=False)) == text


def test_decode_spm_leading_space_like_llama_cpp():
    tok = tokenizer(STORIES)
    ids = tok.encode("Once upon a time", add_special=True)
    assert tok.decode(ids) == " Once upon a time"  # BOS renders empty and keeps the space
    assert tok.decode(ids, unparse_special=True) == "<s> Once upon a time"
    assert tok.decode(ids[1:]) == "Once upon a time"
    assert [tok.token_to_piece(i) for i in ids[:3]] == ["<s>", " Once", " upon"]
    assert tok.token_to_piece(ids[0], special=False) == ""


def test_decode_bpe_cleans_spaces_like_llama_cpp():
    tok = vocab("gpt-2")  # clean_spaces: " ," " ." " !" " ?" and " 's" lose the space
    assert tok.decode(tok.encode("Hello , world ! It 's me .", add_special=False)) == "Hello, world! It's me."
    tok = vocab("deepseek-coder")  # no clean-up for this pre-tokenizer
    assert tok.decode(tok.encode("Hello , world !", add_special=False)) == "Hello , world !"


def test_decode_rejects_out_of_range_ids():
    with pytest.raises(LlmtuneError, match="out of range"):
        tokenizer(STORIES).decode([1, 512])


# -- pre-tokenizers --------------------------------------------------------------------------------


def test_gpt2_and_llama3_pre_tokenizers():
    gpt2 = RegexSplitter(PRE_TOKENIZERS["gpt-2"].patterns)
    assert gpt2("Hello world's  x") == ["Hello", " world", "'s", " ", " x"]
    llama3 = RegexSplitter(PRE_TOKENIZERS["llama3"].patterns)
    assert llama3("Hello world's 1234567\n\n  x") == ["Hello", " world", "'s", " ", "123", "456", "7", "\n\n", " ",
                                                      " x"]
    assert llama3("I'LL go") == ["I", "'LL", " go"]


def test_collapsed_category_classes_like_llama_cpp():
    falcon = RegexSplitter(PRE_TOKENIZERS["falcon"].patterns)
    assert falcon("«hi» 12345") == ["«", "hi", "»", " ", "123", "45"]
    deepseek = RegexSplitter(PRE_TOKENIZERS["deepseek-coder"].patterns)
    assert deepseek("ab 工作12\n") == ["ab", " ", "工作", "1", "2", "\n"]


# -- errors ----------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_an_error():
    md = dict(metadata(STORIES), **{"tokenizer.ggml.model": "t5"})  # (UGM: not implemented)
    with pytest.raises(LlmtuneError, match=r"x\.gguf: unsupported tokenizer model 't5'"):
        Tokenizer.from_metadata(md, source="x.gguf")


def test_cli_unsupported_tokenizer_model_is_one_line_exit_2(tmp_path):


    gf = load_gguf(STORIES)
    meta = dict(gf.meta, **{"tokenizer.ggml.model": MetaValue("t5", VT.STRING)})
    t5 = write_gguf(tmp_path / "t5.gguf", gf.arch, meta, [])
    proc = subprocess.run([sys.executable, "-m", "llmtune", "tokenize", str(t5), "-", "--ids"],
                          input="hi", capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "unsupported tokenizer model 't5'" in proc.stderr


def test_unknown_pre_tokenizer_is_an_error():
    md = dict(metadata(VOCABS[0]), **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "klingon"})
    with pytest.raises(LlmtuneError, match=r"y\.gguf: unsupported pre-tokenizer 'klingon'"):
        Tokenizer.from_metadata(md, source="y.gguf")


def test_missing_tokenizer_is_an_error():
    with pytest.raises(LlmtuneError, match="z.gguf: no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "llama"}, source="z.gguf")


# -- CLI -------------------------------------------------------------------------------------------


def test_cli_lists_pieces_like_llama_tokenize(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("Once upon a time", encoding="utf-8")
    result = CliRunner().invoke(app, ["tokenize", str(STORIES), str(src)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["     1 -> '<s>'", "   403 -> ' Once'", "   407 -> ' upon'",
                                          "   261 -> ' a'", "   378 -> ' time'"]  # fmt: skip


def test_cli_ids_from_stdin_and_no_bos():
    tok = tokenizer(STORIES)
    result = CliRunner().invoke(app, ["tokenize", str(STORIES), "-", "--ids", "--no-bos"], input="Once upon a time")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == tok.encode("Once upon a time", add_special=False)
    result = CliRunner().invoke(app, ["tokenize", str(STORIES), "--ids"], input="hi <s>")
    assert json.loads(result.output) == tok.encode("hi <s>", parse_special=True)  # llama-tokenize parses <s>


@pytest.mark.parametrize("content, problem", [(None, "no such file"), (b"ok \xff\xfe", "not valid UTF-8 text")])
def test_cli_bad_input_is_one_line_error(tmp_path, content, problem):
    src = tmp_path / "in.txt"
    if content is not None:
        src.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "llmtune", "tokenize", str(STORIES), str(src)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and problem in proc.stderr and str(src) in proc.stderr
    assert "Traceback" not in proc.stderr
