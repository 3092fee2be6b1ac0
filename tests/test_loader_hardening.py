"""Loader hardening (issue 15): one test per damaged-file case the issue names or the fuzzer
(tests/test_fuzz.py) found. Each must end in a one-line LlmtuneError that names the file and
the problem, or (for `info`, which describes any readable file) in a rendering that says what
is wrong.
"""

from __future__ import annotations

import io
import re
import struct
import tempfile
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT
from rich.console import Console

from cli_helpers import run_cli
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.tokenizer import Tokenizer
from llmtune.ui.info import render_info
from test_fuzz import KV, STORIES, parse, serialize, small_bpe_vocab, with_kv, with_tensor

STORIES_LAYOUT = parse(STORIES.read_bytes())
TEXT = "Once upon a time, there was a little dog. It liked to play in the park with its friends.\n" * 8


def write(tmp_path: Path, blob: bytes, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def one_line_error(exc_info, path: Path) -> str:
    message = str(exc_info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def info_text(path: Path) -> str:
    """`info` as printed to a strict UTF-8 stdout (what a terminal gets)."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    Console(file=stream, width=160, color_system=None).print(render_info(path))
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8")


def assert_cli_error(monkeypatch, capsys, path: Path, *args, words=()) -> None:
    code, out, err = run_cli(monkeypatch, capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert str(path) in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


# -- special token ids of the wrong type ------------------------------------------------------------


def test_bos_token_id_stored_as_a_string(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, with_kv(STORIES_LAYOUT, "tokenizer.ggml.bos_token_id", VT.STRING, b"1"))
    # the tokenizer refuses it, as llama.cpp does ("key has wrong type")
    with pytest.raises(LlmtuneError) as exc:
        Tokenizer.from_gguf(load_gguf(path))
    assert one_line_error(exc, path).endswith("tokenizer.ggml.bos_token_id must be an integer token id, got '1'")
    # info describes the file and shows the bad value
    assert re.search(r"^\s*bos token\s+'1' \(not a token id\)\s+tokenizer\.ggml\.bos_token_id", info_text(path), re.M)
    # every command that tokenizes gives the one-line error
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "out.gguf"
    for args in (
        ["tokenize", path, text],
        ["perplexity", path, text, "--ctx", "16", "--chunks", "1"],
        ["finetune", path, text, "-o", out, "--ctx", "16", "--epochs", "1"],
    ):
        assert_cli_error(monkeypatch, capsys, path, *args, words=["bos_token_id"])
    assert not out.exists()


@pytest.mark.parametrize(
    "key, vtype, value, shown",
    [
        ("tokenizer.ggml.eos_token_id", VT.FLOAT32, 2.0, "2.0"),
        ("tokenizer.ggml.unknown_token_id", VT.BOOL, 1, "True"),
        ("tokenizer.ggml.padding_token_id", VT.ARRAY, (VT.UINT32, [1, 2]), "[1, 2]"),
    ],
)
def test_special_token_ids_of_other_types(tmp_path, key, vtype, value, shown):
    path = write(tmp_path, with_kv(STORIES_LAYOUT, key, vtype, value))
    with pytest.raises(LlmtuneError) as exc:
        Tokenizer.from_gguf(load_gguf(path))
    assert one_line_error(exc, path).endswith(f"{key} must be an integer token id, got {shown}")
    assert f"{shown} (not a token id)" in info_text(path)


# -- tensor data: shared, overlapping, misaligned --------------------------------------------------


def test_two_tensors_sharing_one_data_offset(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, with_tensor(STORIES_LAYOUT, "blk.0.attn_k.weight", offset_from=("blk.0.attn_q.weight", 0)))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    message = one_line_error(exc, path)
    assert "corrupt GGUF (tensors 'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' share data" in message
    assert re.search(r"both start at data offset [\d,]+\)$", message), message
    assert_cli_error(monkeypatch, capsys, path, "info", path, words=["share data"])


def test_overlapping_tensor_data(tmp_path):
    # attn_k starts 64 bytes into attn_q's 16 KiB: aligned, inside the file, and still wrong
    path = write(tmp_path, with_tensor(STORIES_LAYOUT, "blk.0.attn_k.weight", offset_from=("blk.0.attn_q.weight", 64)))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    message = one_line_error(exc, path)
    assert "tensors 'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' share data" in message
    assert "'blk.0.attn_k.weight' starts at data offset" in message and "before 'blk.0.attn_q.weight' ends" in message


def test_zero_size_tensors_may_share_an_offset(tmp_path):
    """A tensor with no elements occupies no bytes (llama.cpp lays the next one at the same offset)."""
    data = STORIES_LAYOUT.data + bytes(32)
    offset = len(STORIES_LAYOUT.data)
    tensors = STORIES_LAYOUT.tensors + [
        type(STORIES_LAYOUT.tensors[0])(b"empty.a", [0], 0, offset),
        type(STORIES_LAYOUT.tensors[0])(b"empty.b", [8, 0], 0, offset),
        type(STORIES_LAYOUT.tensors[0])(b"small", [8], 0, offset),
    ]
    gf = load_gguf(write(tmp_path, serialize(STORIES_LAYOUT, tensors=tensors, data=data)))
    assert gf.tensors["empty.b"].shape == (0, 8) and gf.tensor("small").shape == (8,)


def test_misaligned_tensor_data_offset(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, with_tensor(STORIES_LAYOUT, "blk.0.attn_k.weight", offset_from=("blk.0.attn_k.weight", 4)))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    assert re.search(
        r"corrupt GGUF \(tensor 'blk\.0\.attn_k\.weight' data offset [\d,]+ is not a multiple of the alignment 32\)$",
        one_line_error(exc, path),
    )
    assert_cli_error(monkeypatch, capsys, path, "info", path, words=["not a multiple of the alignment"])


# -- tensor descriptors ------------------------------------------------------------------------------


@pytest.mark.parametrize("ne", [[2**64 - 1, 0], [0, 2**63], [2**32, 2**32], [2**21] * 4], ids=str)
def test_impossible_tensor_dimensions(tmp_path, ne):
    """Sizes past int64 are refused before anything is allocated (a zero dim does not excuse them)."""
    path = write(tmp_path, with_tensor(STORIES_LAYOUT, "output_norm.weight", ne=ne))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    assert one_line_error(exc, path).endswith("corrupt GGUF (tensor 'output_norm.weight' has impossible "
                                              f"dimensions {ne})")


def test_more_than_four_dimensions(tmp_path):
    path = write(tmp_path, with_tensor(STORIES_LAYOUT, "output_norm.weight", ne=[64, 1, 1, 1, 1]))
    with pytest.raises(LlmtuneError, match=r"tensor 'output_norm\.weight' has 5 dimensions \(1\.\.4 allowed\)"):
        load_gguf(path)


def test_unknown_tensor_type_ids(tmp_path):
    for type_id in (4, 31, 2**32 - 1):
        path = write(tmp_path, with_tensor(STORIES_LAYOUT, "blk.1.ffn_up.weight", ttype=type_id))
        with pytest.raises(LlmtuneError) as exc:
            load_gguf(path)
        assert one_line_error(exc, path).endswith(f"tensor 'blk.1.ffn_up.weight' has unsupported type id {type_id}")


# -- metadata ------------------------------------------------------------------------------------------


def test_arrays_nested_too_deep(tmp_path):
    value = (VT.UINT8, [])
    for _ in range(40):
        value = (VT.ARRAY, [value])
    path = write(tmp_path, with_kv(STORIES_LAYOUT, "general.deep", VT.ARRAY, value))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    assert "corrupt GGUF (arrays nested more than 16 deep in metadata entry" in one_line_error(exc, path)
    # a few levels are fine (the gguf package writes arrays of arrays)
    value = (VT.ARRAY, [(VT.ARRAY, [(VT.INT32, [1, 2])])])
    gf = load_gguf(write(tmp_path, with_kv(STORIES_LAYOUT, "general.nested", VT.ARRAY, value), "ok.gguf"))
    assert gf.get("general.nested") == [[[1, 2]]]


def test_info_prints_strings_with_invalid_utf8(tmp_path, monkeypatch, capsys):
    """Undecodable bytes stay in the metadata (written back unchanged) but print as U+FFFD."""
    kvs = [kv for kv in STORIES_LAYOUT.kvs if kv.key not in (b"general.name", b"general.architecture")]
    kvs += [KV(b"general.name", VT.STRING, b"st\xffories"), KV(b"general.architecture", VT.STRING, b"lla\xedma")]
    path = write(tmp_path, serialize(STORIES_LAYOUT, kvs))
    assert load_gguf(path).get("general.name") == "st\udcffories"
    code, out, err = run_cli(monkeypatch, capsys, "info", path)  # capsys' stdout is strict UTF-8
    assert code == 0, err
    assert re.search(r"^\s*name\s+st\ufffdories", out, re.M), out
    assert re.search(r"^\s*architecture\s+lla\ufffdma\s+llmtune cannot run it", out, re.M), out


# -- tokenizer metadata of the wrong shape -----------------------------------------------------------


@pytest.mark.parametrize(
    "key, vtype, value, words",
    [
        ("tokenizer.ggml.tokens", VT.ARRAY, (VT.INT32, list(range(512))),
         "tokenizer.ggml.tokens must be an array of strings"),
        ("tokenizer.ggml.tokens", VT.ARRAY, (VT.ARRAY, [(VT.STRING, [b"a"])] * 3),
         "tokenizer.ggml.tokens must be an array of strings"),
        ("tokenizer.ggml.token_type", VT.ARRAY, (VT.STRING, [b"1"] * 512),
         "tokenizer.ggml.token_type must be an array of integers"),
        ("tokenizer.ggml.token_type", VT.STRING, b"normal", "tokenizer.ggml.token_type must be an array of integers"),
        ("tokenizer.ggml.token_type", VT.ARRAY, (VT.INT32, [1] * 10),
         "tokenizer.ggml.token_type has 10 entries for 512 tokens"),
        ("tokenizer.ggml.scores", VT.ARRAY, (VT.STRING, [b"0.5"] * 512),
         "tokenizer.ggml.scores must be an array of numbers"),
        ("tokenizer.ggml.scores", VT.FLOAT32, 0.5, "tokenizer.ggml.scores must be an array of numbers"),
        ("tokenizer.ggml.add_bos_token", VT.STRING, b"false",
         "tokenizer.ggml.add_bos_token must be true or false, got 'false'"),
        ("tokenizer.ggml.add_eos_token", VT.ARRAY, (VT.BOOL, [1]),
         "tokenizer.ggml.add_eos_token must be true or false, got [True]"),
    ],
)  # fmt: skip
def test_spm_tokenizer_metadata_of_the_wrong_type(tmp_path, key, vtype, value, words):
    path = write(tmp_path, with_kv(STORIES_LAYOUT, key, vtype, value))
    with pytest.raises(LlmtuneError) as exc:
        Tokenizer.from_gguf(load_gguf(path))
    assert one_line_error(exc, path).endswith(words)
    info_text(path)  # info still describes the file


@pytest.fixture(scope="module")
def bpe_layout(tmp_path_factory):
    return parse(small_bpe_vocab(tmp_path_factory.mktemp("bpe") / "bpe-1k.gguf").read_bytes())


@pytest.mark.parametrize(
    "key, vtype, value, words",
    [
        ("tokenizer.ggml.merges", VT.ARRAY, (VT.ARRAY, [(VT.STRING, [b"a", b"b"])]),
         "tokenizer.ggml.merges must be an array of strings"),
        ("tokenizer.ggml.merges", VT.INT32, 5, "tokenizer.ggml.merges must be an array of strings"),
        ("tokenizer.ggml.merges", VT.STRING, b"a b", "tokenizer.ggml.merges must be an array of strings"),
        ("tokenizer.ggml.pre", VT.UINT32, 2, "tokenizer.ggml.pre must be a string, got 2"),
        ("tokenizer.ggml.pre", VT.ARRAY, (VT.STRING, [b"gpt-2"]), "tokenizer.ggml.pre must be a string, got ['gpt-2']"),
        ("tokenizer.ggml.model", VT.ARRAY, (VT.STRING, [b"gpt2"]), "unsupported tokenizer model ['gpt2']"),
    ],
)  # fmt: skip
def test_bpe_tokenizer_metadata_of_the_wrong_type(tmp_path, bpe_layout, key, vtype, value, words):
    path = write(tmp_path, with_kv(bpe_layout, key, vtype, value))
    with pytest.raises(LlmtuneError) as exc:
        Tokenizer.from_gguf(load_gguf(path))
    assert words in one_line_error(exc, path)
    info_text(path)


def test_byte_tokens_with_damaged_text_decode_like_llamacpp(tmp_path):
    """A token typed BYTE whose text is not <0xXX>: llama.cpp's strtol reads the hex digits it finds."""
    types = [2, 3, 3] + [6] * 509  # every ordinary token typed as a byte token
    gf = load_gguf(write(tmp_path, with_kv(STORIES_LAYOUT, "tokenizer.ggml.token_type", VT.ARRAY, (VT.INT32, types))))
    tok = Tokenizer.from_gguf(gf)
    texts = {t: i for i, t in enumerate(tok.tokens)}
    assert tok.token_to_bytes(texts["<0x0A>"]) == b"\n"
    assert tok.token_to_bytes(texts["▁the"]) == b"\x0e"  # "▁the"[3:5] == "e"
    assert tok.token_to_bytes(texts["▁a"]) == b"\x00"  # no hex digits: 0
    tok.decode(tok.encode("the cat sat on the mat"))


# -- the structural helpers the fuzzer relies on ----------------------------------------------------


def test_fuzzer_parser_round_trips_the_base_files(bpe_layout):
    assert serialize(STORIES_LAYOUT) == STORIES.read_bytes()
    assert serialize(bpe_layout) == bpe_layout.blob
    assert len(STORIES_LAYOUT.tensors) == 48 and STORIES_LAYOUT.alignment == 32
    version = next(f for f in STORIES_LAYOUT.fields if f.label == "version")
    assert (version.offset, version.value) == (4, 3) and struct.unpack_from("<I", STORIES_LAYOUT.blob, 4) == (3,)
    tok = Tokenizer.from_gguf(load_gguf(STORIES.parent / "vocab" / "ggml-vocab-gpt-2.gguf"))
    small = Tokenizer.from_metadata({k: v for k, v in _plain(bpe_layout).items()}, source="bpe-1k")
    text = "Hello world, the quick brown fox."
    assert small.decode(small.encode(text)) == tok.decode(tok.encode(text)) == text


def _plain(layout) -> dict:

    with tempfile.TemporaryDirectory() as tmp:
        return load_gguf(write(Path(tmp), layout.blob, "v.gguf")).metadata
