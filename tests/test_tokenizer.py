"""Tokenizers against llama.cpp: its tokenizer test vectors, llama-tokenize on WikiText-2, the CLI."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llmtune.cli import app
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.bpe import PRE_TOKENIZERS, RegexSplitter

DATA = Path(__file__).parent / "data"
VOCABS = sorted((DATA / "vocab").glob("ggml-vocab-*.gguf"))
STORIES = DATA / "stories260K.gguf"


@lru_cache(maxsize=None)
def tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(load_gguf(path))


@lru_cache(maxsize=None)
def metadata(path: Path) -> dict:
    return load_gguf(path).metadata


def vocab(name: str) -> Tokenizer:
    return tokenizer(DATA / "vocab" / f"ggml-vocab-{name}.gguf")


def read_vocab_tests(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs exactly as llama.cpp's tests/test-tokenizer-0 reads them.

    Texts are the raw bytes of `.inp` split on "\\n__ggml_vocab_test__\\n" (a final separator
    ends the list, it does not open an empty text); `.out` has one line per text, stripped,
    ids separated by spaces.
    """
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


def test_vocab_fixtures_cover_spm_and_bpe():
    kinds = {vocab(p.name[len("ggml-vocab-") : -len(".gguf")]).kind for p in VOCABS}
    assert len(VOCABS) >= 6 and kinds == {"spm", "bpe"}


@pytest.mark.parametrize("path", VOCABS, ids=lambda p: p.name[len("ggml-vocab-") : -len(".gguf")])
def test_llama_cpp_vocab_vectors(path: Path):
    """test-tokenizer-0 tokenizes with add_special=false, parse_special=false."""
    tok = tokenizer(path)
    cases = read_vocab_tests(path)
    assert len(cases) > 40
    failures = [
        (text, expected, got)
        for text, expected in cases
        if (got := tok.encode(text, add_special=False, parse_special=False)) != expected
    ]
    assert not failures, "\n".join(f"{t!r}: expected {e}, got {g}" for t, e, g in failures[:5])


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
    assert tok.encode("<|user|>   Hi", add_special=False, parse_special=True) == [user, *tok.encode("Hi", add_special=False)]
    # <s> is exempt: its following spaces stay (and get the ▁ prefix)
    assert tok.encode("<s> Hi", add_special=False, parse_special=True) == [tok.bos_id, *tok.encode(" Hi", add_special=False)]


# -- decoding ------------------------------------------------------------------------------------------

ROUND_TRIP_TEXTS = ["Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "Äpfel 🦙 нещо 我想在apple工作", "3333 x"]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "deepseek-coder", "starcoder", "gpt-2", "falcon"])
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
    assert llama3("Hello world's 1234567\n\n  x") == ["Hello", " world", "'s", " ", "123", "456", "7", "\n\n", " ", " x"]
    assert llama3("I'LL go") == ["I", "'LL", " go"]


def test_collapsed_category_classes_like_llama_cpp():
    falcon = RegexSplitter(PRE_TOKENIZERS["falcon"].patterns)
    assert falcon("«hi» 12345") == ["«", "hi", "»", " ", "123", "45"]
    deepseek = RegexSplitter(PRE_TOKENIZERS["deepseek-coder"].patterns)
    assert deepseek("ab 工作12\n") == ["ab", " ", "工作", "1", "2", "\n"]


# -- errors ----------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_an_error():
    md = dict(metadata(STORIES), **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(LlmtuneError, match=r"x\.gguf: unsupported tokenizer model 'bert'"):
        Tokenizer.from_metadata(md, source="x.gguf")


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
