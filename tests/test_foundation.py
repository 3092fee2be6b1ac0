"""Foundation: GGUF I/O (round trips, damaged files), `info`, `init`, and one-line user errors.

CLI checks run `python -m llmtune ...` in a subprocess, as a user would, and require: exit
code 2, exactly one line on stderr naming the file and the problem, no traceback.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import typer.main
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from rich.console import Console

from llmtune.arch import get_family
from llmtune.cli import app
from llmtune.convert.init import init_model, load_init_config
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue, check_output_path, load_gguf, write_gguf
from llmtune.model.loaded import hparams_of, load_model
from llmtune.ui.format import human_bytes, human_count
from llmtune.ui.info import render_info

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
SPM_VOCAB = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
VOCABS = sorted((DATA / "vocab").glob("*.gguf"))
CONFIG_15M = REPO / "configs" / "llama-15m.toml"
CONFIG_110M = REPO / "configs" / "llama-110m.toml"


# -- helpers ------------------------------------------------------------------------------------


def run_cli(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmtune", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )


def assert_user_error(result: subprocess.CompletedProcess, path, *words: str) -> str:
    """Exit 2, one stderr line that names `path` and contains every word, no traceback."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert str(path) in line, line
    for word in words:
        assert word.lower() in line.lower(), (word, line)
    return line


def render_text(path) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render_info(path))
    return console.file.getvalue()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cut(src: Path, n: int, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def tensor_type_offset(path: Path, name: str) -> int:
    """Byte offset of the type id in tensor `name`'s descriptor (name, n_dims, ne[], type)."""
    blob = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    start = blob.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", blob, start)
    return start + 4 + 8 * n_dims


def patch_u32(path: Path, offset: int, value: int) -> None:
    blob = bytearray(path.read_bytes())
    struct.pack_into("<I", blob, offset, value)
    path.write_bytes(bytes(blob))


def write_mamba(path: Path) -> Path:
    """A small, well-formed GGUF of an architecture llmtune cannot run (with a real tokenizer)."""
    tok = {k: v for k, v in load_gguf(STORIES).meta.items() if k.startswith("tokenizer.")}
    u32 = lambda v: MetaValue(v, VT.UINT32)  # noqa: E731
    meta = {
        "general.name": MetaValue("tiny-mamba", VT.STRING),
        "mamba.context_length": u32(64), "mamba.embedding_length": u32(16), "mamba.block_count": u32(1),
        "mamba.feed_forward_length": u32(0), "mamba.attention.head_count": u32(0),
        "mamba.ssm.conv_kernel": u32(4), "mamba.ssm.inner_size": u32(32), "mamba.ssm.state_size": u32(16),
        **tok,
    }
    tensors = [
        ("token_embd.weight", np.zeros((512, 16), np.float32), QT.F32),
        ("blk.0.ssm_in.weight", np.zeros((64, 16), np.float32), QT.F32),
        ("output_norm.weight", np.ones(16, np.float32), QT.F32),
    ]
    return write_gguf(path, "mamba", meta, tensors)


def registered_commands() -> set[str]:


    return set(typer.main.get_command(app).commands)


# -- damaged and wrong inputs, through the CLI ---------------------------------------------------

# (case id, how to make it from tmp_path, words the error must contain)
STORIES_SIZE = STORIES.stat().st_size
BAD_MODEL_CASES = {
    "missing": (lambda d: d / "nope.gguf", ["no such file"]),
    "directory": (lambda d: d, ["directory"]),
    "empty": (lambda d: cut(STORIES, 0, d / "empty.gguf"), ["empty"]),
    "not-gguf": (lambda d: Path(shutil.copy(REPO / "pyproject.toml", d / "model.gguf")), ["not a GGUF"]),
    "cut-in-header": (lambda d: cut(STORIES, 13, d / "h.gguf"), ["truncated", "header"]),
    "cut-in-metadata": (lambda d: cut(STORIES, 5000, d / "m.gguf"), ["truncated", "metadata", "tokenizer.ggml.tokens"]),
    "cut-in-tensor-table": (lambda d: cut(STORIES, 14000, d / "t.gguf"), ["truncated", "tensor descriptor"]),
    "cut-in-tensor-data": (lambda d: cut(STORIES, STORIES_SIZE // 2, d / "d.gguf"), ["truncated", "tensor data"]),
    "one-byte-short": (lambda d: cut(STORIES, STORIES_SIZE - 1, d / "s.gguf"), ["truncated", "blk.4.ffn_norm.weight"]),
}


@pytest.mark.parametrize("case", list(BAD_MODEL_CASES))
def test_info_rejects_bad_model_files(tmp_path, case):
    make, words = BAD_MODEL_CASES[case]
    path = make(tmp_path)
    assert_user_error(run_cli("info", path), path, *words)


def _model_commands(model: Path, tmp: Path) -> dict[str, list]:
    """Every command that reads a model, invoked as a user would."""
    out = tmp / "out" / "result.gguf"
    text = REPO / "data" / "wikitext-100k.txt"
    return {
        "init": ["init", "--config", CONFIG_15M, "--vocab-from", model, "-o", out],
        "tokenize": ["tokenize", model, text, "--ids"],
        "perplexity": ["perplexity", model, text, "--ctx", "64", "--chunks", "1"],
        "export": ["export", model, "-o", out, "--type", "f16"],
        "finetune": ["finetune", model, text, "-o", out],
    }


# every model-reading command goes through load_gguf; these cases check that none reads the file its own way
@pytest.mark.parametrize("command", ["init", "tokenize", "perplexity", "export", "finetune"])
@pytest.mark.parametrize("case", ["missing", "not-gguf", "cut-in-tensor-data"])
def test_model_commands_reject_bad_model_files(tmp_path, command, case):
    if command not in registered_commands():
        pytest.skip(f"`llmtune {command}` is not registered yet")
    make, words = BAD_MODEL_CASES[case]
    if command == "init" and case == "cut-in-tensor-data":
        words = []  # init reads only the tokenizer; any one-line error naming the file will do
    inputs = tmp_path / "in"
    inputs.mkdir()
    path = make(inputs)
    assert_user_error(run_cli(*_model_commands(path, tmp_path)[command]), path, *words)
    assert not (tmp_path / "out" / "result.gguf").exists()


def test_unsupported_architecture(tmp_path):
    mamba = write_mamba(tmp_path / "mamba.gguf")
    # info describes any GGUF, but says llmtune cannot run this one
    result = run_cli("info", mamba)
    assert result.returncode == 0, result.stderr
    assert "mamba" in result.stdout and "cannot run" in result.stdout
    # loading it as a model is a user error
    with pytest.raises(LlmtuneError, match=r"mamba\.gguf: unsupported architecture 'mamba'"):
        hparams_of(load_gguf(mamba))
    for command in ("perplexity", "finetune"):
        if command in registered_commands():
            result = run_cli(*_model_commands(mamba, tmp_path)[command])
            assert_user_error(result, mamba, "unsupported architecture", "mamba")
    # and so is asking init for one
    config = tmp_path / "mamba.toml"
    config.write_text(CONFIG_15M.read_text().replace('architecture = "llama"', 'architecture = "mamba"'))
    result = run_cli("init", "--config", config, "--vocab-from", SPM_VOCAB, "-o", tmp_path / "new.gguf")
    assert_user_error(result, config, "unsupported architecture", "mamba")


def test_unknown_tensor_type_id(tmp_path):
    model = tmp_path / "odd.gguf"
    shutil.copy(STORIES, model)
    patch_u32(model, tensor_type_offset(model, "blk.2.attn_k.weight"), 4)  # 4 was Q4_2, removed from ggml
    assert_user_error(run_cli("info", model), model, "blk.2.attn_k.weight", "unsupported type id 4")


def test_tensor_type_without_dequantizer(tmp_path):
    """Q8_K is a valid GGML type (llama.cpp's matmul scratch format) that no model file should need."""
    gf = load_gguf(STORIES)
    block = np.random.default_rng(0).integers(0, 255, (4, gguf.GGML_QUANT_SIZES[QT.Q8_K][1]), dtype=np.uint8)
    tensors = [(t.name, t.raw, t.type) for t in gf.tensors.values()] + [("extra.weight", block, QT.Q8_K)]
    path = write_gguf(tmp_path / "q8k.gguf", gf.arch, gf.meta, tensors)
    loaded = load_gguf(path)
    assert loaded.tensors["extra.weight"].shape == (4, 256)
    assert "Q8_K" in render_text(path)  # info still describes it
    with pytest.raises(LlmtuneError, match=r"q8k\.gguf: tensor extra\.weight has unsupported type Q8_K"):
        loaded.tensor("extra.weight")
    if "export" in registered_commands():
        assert_user_error(run_cli(*_model_commands(path, tmp_path)["export"]), path, "Q8_K")


@pytest.mark.parametrize(
    "patch, words",
    [
        (lambda b: struct.pack_into("<I", b, 4, 7), "unsupported GGUF version 7"),
        (lambda b: struct.pack_into("<I", b, 4, 3 << 16), "big-endian"),
        # the value type of the first metadata entry (after its key 'tokenizer.ggml.tokens')
        (lambda b: struct.pack_into("<I", b, 24 + 8 + 21, 77), "unknown metadata value type 77"),
    ],
)
def test_corrupt_headers(tmp_path, patch, words):
    blob = bytearray(STORIES.read_bytes())
    patch(blob)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(LlmtuneError) as exc:
        load_gguf(path)
    assert str(exc.value).startswith(f"{path}: ") and words in str(exc.value)


def test_bad_tensor_descriptor(tmp_path):
    path = tmp_path / "dims.gguf"
    shutil.copy(STORIES, path)
    patch_u32(path, tensor_type_offset(path, "output_norm.weight") - 12, 9)  # n_dims: 1 -> 9
    assert_user_error(run_cli("info", path), path, "corrupt", "9 dimensions")


# -- GGUF round trips ----------------------------------------------------------------------------


def _meta_with_types(gf) -> dict:
    return {k: (v.type, v.sub_type, v.value) for k, v in gf.meta.items()}


@pytest.mark.parametrize("src", [STORIES, *VOCABS], ids=lambda p: p.name)
def test_round_trip_is_byte_identical(tmp_path, src):
    gf = load_gguf(src)
    out = write_gguf(tmp_path / "copy.gguf", gf.arch, gf.meta, [(t.name, t.raw, t.type) for t in gf.tensors.values()])
    assert out.read_bytes() == src.read_bytes()
    back = load_gguf(out)
    assert _meta_with_types(back) == _meta_with_types(gf)
    assert list(back.meta) == list(gf.meta)


def test_reader_agrees_with_gguf_package():
    """Our parser against the reference reader: every key, type and tensor byte."""
    for src in [STORIES, SPM_VOCAB]:
        ours, ref = load_gguf(src), gguf.GGUFReader(src)
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(ours.meta) == ref_keys
        for key in ref_keys:
            field = ref.fields[key]
            assert ours.meta[key].type == field.types[0], key
            assert ours.meta[key].value == field.contents(), key
        for t in ref.tensors:
            mine = ours.tensors[t.name]
            assert mine.type == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
            assert np.array_equal(np.asarray(mine.raw), t.data)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16])
def test_round_trip_float_types(tmp_path, qtype):
    gf = load_gguf(STORIES)
    weights = {name: gf.tensor(name) for name in gf.tensors}
    out = write_gguf(tmp_path / f"{qtype.name}.gguf", gf.arch, gf.meta, [(n, w, qtype) for n, w in weights.items()])
    back = load_gguf(out)
    assert _meta_with_types(back) == _meta_with_types(gf)
    assert list(back.tensors) == list(gf.tensors)
    for name, w in weights.items():
        assert back.tensors[name].type == qtype and back.tensors[name].shape == w.shape
        got = back.tensor(name)
        if qtype == QT.F32:
            assert np.array_equal(got.view(np.uint32), w.view(np.uint32)), name  # bit-exact
        elif qtype == QT.F16:
            assert np.array_equal(got, w.astype(np.float16).astype(np.float32)), name
        else:  # bf16: round-to-nearest-even of the top 16 bits, as gguf/ggml do it
            expected = gguf.quants.dequantize(gguf.quants.quantize(w, QT.BF16), QT.BF16)
            assert np.array_equal(got, expected), name
            assert np.max(np.abs(got - w)) <= np.max(np.abs(w)) * 2**-8
    # the reference reader reads what we wrote
    ref = gguf.GGUFReader(out)
    assert [t.tensor_type for t in ref.tensors] == [qtype] * len(weights)
    # and a second round trip of the stored bytes changes nothing
    again = write_gguf(tmp_path / "again.gguf", back.arch, back.meta,
                       [(t.name, t.raw, t.type) for t in back.tensors.values()])
    assert again.read_bytes() == out.read_bytes()


def test_round_trip_every_metadata_type(tmp_path):
    meta = {
        "t.u8": MetaValue(255, VT.UINT8), "t.i8": MetaValue(-128, VT.INT8),
        "t.u16": MetaValue(65535, VT.UINT16), "t.i16": MetaValue(-32768, VT.INT16),
        "t.u32": MetaValue(2**32 - 1, VT.UINT32), "t.i32": MetaValue(-(2**31), VT.INT32),
        "t.u64": MetaValue(2**64 - 1, VT.UINT64), "t.i64": MetaValue(-(2**63), VT.INT64),
        "t.f32": MetaValue(float(np.float32(0.1)), VT.FLOAT32), "t.f64": MetaValue(0.1, VT.FLOAT64),
        "t.bool": MetaValue(True, VT.BOOL), "t.str": MetaValue("héllo\nwörld", VT.STRING),
        "t.bad_utf8": MetaValue(b"\xff\xfe ok".decode("utf-8", "surrogateescape"), VT.STRING),
        "t.arr_i64": MetaValue([1, -2, 3], VT.ARRAY, VT.INT64),
        "t.arr_f32": MetaValue([0.5, -1.25], VT.ARRAY, VT.FLOAT32),
        "t.arr_bool": MetaValue([True, False], VT.ARRAY, VT.BOOL),
        "t.arr_str": MetaValue(["a", "", "<0x0A>"], VT.ARRAY, VT.STRING),
        "t.arr_empty": MetaValue([], VT.ARRAY, VT.UINT32),
        "t.arr_nested": MetaValue([MetaValue([1, 2], VT.ARRAY, VT.UINT16), MetaValue(["x"], VT.ARRAY, VT.STRING)],
                                  VT.ARRAY, VT.ARRAY),
    }
    path = write_gguf(tmp_path / "types.gguf", "test", meta, [])
    back = load_gguf(path)
    assert back.meta == {"general.architecture": MetaValue("test", VT.STRING), **meta}
    assert back.get("t.arr_nested") == [[1, 2], ["x"]]
    again = write_gguf(tmp_path / "types2.gguf", back.arch, back.meta, [])
    assert again.read_bytes() == path.read_bytes()


def test_writing_over_the_input_is_refused(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(STORIES, model)
    before = sha256(model)
    gf = load_gguf(model)
    tensors = [(t.name, t.raw, t.type) for t in gf.tensors.values()]
    (tmp_path / "sub").mkdir()
    for spelling in [model, tmp_path / "sub" / ".." / "m.gguf"]:
        with pytest.raises(LlmtuneError, match="refusing to overwrite the input"):
            write_gguf(spelling, gf.arch, gf.meta, tensors, inputs=[model])
    hard_link = tmp_path / "link.gguf"
    hard_link.hardlink_to(model)
    with pytest.raises(LlmtuneError, match="refusing to overwrite the input"):
        write_gguf(hard_link, gf.arch, gf.meta, tensors, inputs=[model])
    assert sha256(model) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "m.gguf", "sub"]  # no temp files left
    # through the CLI: init writing over its vocabulary source
    result = run_cli("init", "--config", CONFIG_15M, "--vocab-from", model, "-o", model)
    assert_user_error(result, model, "refusing to overwrite")
    assert sha256(model) == before


def test_output_folder_is_created_and_a_file_in_the_way_is_reported(tmp_path):
    gf = load_gguf(SPM_VOCAB)
    out = write_gguf(tmp_path / "new" / "deeper" / "v.gguf", gf.arch, gf.meta, [])
    assert load_gguf(out).meta == gf.meta
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LlmtuneError, match="not a directory"):
        write_gguf(tmp_path / "afile" / "v.gguf", gf.arch, gf.meta, [])
    # checking a path prepares its folder, for writers that open the file themselves
    metrics = check_output_path(tmp_path / "runs" / "m.jsonl", SPM_VOCAB)
    metrics.write_text("{}\n")


# -- info ---------------------------------------------------------------------------------------


def test_info_on_a_model():
    result = run_cli("info", STORIES)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    expected_rows = {
        "architecture": "llama", "parameters": "292.8K", "n_vocab": "512", "n_ctx_train": "2048",
        "n_embd": "64", "n_layer": "5", "n_head": "8", "n_head_kv": "4", "n_ff": "172", "n_rot": "8",
        "rope base": "10000", "rope scale": "1", "norm eps": "1e-05", "tied output": "no",
        "kind": "SPM", "vocab size": "512", "bos token": "1 '<s>'", "eos token": "2 '</s>'",
        "unk token": "0 '<unk>'", "pad token": "none", "size": "1.1 MiB",
    }
    for name, value in expected_rows.items():
        assert re.search(rf"^\s*{name}\s+{re.escape(value)}", text, re.M), (name, value, text)
    assert re.search(r"^\s*F32\s+48\s+292,800\s+1\.1 MiB", text, re.M), text


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda p: p.name)
def test_info_on_tokenizer_only_files(vocab):
    gf = load_gguf(vocab)
    text = render_text(vocab)
    kind = {"llama": "SPM", "gpt2": "BPE"}[gf.get("tokenizer.ggml.model")]
    assert re.search(rf"^\s*kind\s+{kind}", text, re.M), text
    assert re.search(rf"^\s*vocab size\s+{len(gf.get('tokenizer.ggml.tokens')):,}\b", text, re.M), text
    assert "tokenizer-only file (no tensors)" in text
    bos = gf.get("tokenizer.ggml.bos_token_id")
    assert f"{bos} {gf.get('tokenizer.ggml.tokens')[bos]!r}" in text
    assert re.search(rf"^\s*n_layer\s+{gf.get(gf.arch + '.block_count')}\b", text, re.M), text


def test_human_units():
    assert [human_count(n) for n in (999, 292_800, 24_407_712, 134_105_856, 7_000_000_000)] == [
        "999", "292.8K", "24.4M", "134.1M", "7.0B"]
    assert [human_bytes(n) for n in (512, 1_185_376, 98_358_112)] == ["512 B", "1.1 MiB", "93.8 MiB"]


# -- init ---------------------------------------------------------------------------------------

N_VOCAB = 32000


def expected_llama_params(n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff) -> int:
    n_embd_kv = n_embd // n_head * n_head_kv
    per_layer = 2 * n_embd * n_embd + 2 * n_embd * n_embd_kv + 3 * n_embd * n_ff + 2 * n_embd
    return 2 * n_vocab * n_embd + n_embd + n_layer * per_layer


@pytest.fixture(scope="module")
def model_15m(tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "m15.gguf"
    result = run_cli("init", "--config", CONFIG_15M, "--vocab-from", SPM_VOCAB, "-o", out, "--seed", 7)
    assert result.returncode == 0, result.stderr
    assert "24.4M parameters" in result.stdout
    return out


def test_init_15m_shape_and_metadata(model_15m):
    gf = load_gguf(model_15m)
    n = expected_llama_params(N_VOCAB, 288, 6, 6, 6, 768)
    assert gf.n_params() == n == 24_407_712
    hp = hparams_of(gf)
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_rot) == (
        N_VOCAB, 256, 288, 6, 6, 6, 768, 48)
    assert not hp.tied_output and hp.norm_eps == pytest.approx(1e-5)
    # tensor names and numpy shapes follow llama.cpp's layout, as in stories260K
    ref = load_gguf(STORIES)
    block_tensors = [n.removeprefix("blk.0.") for n in ref.tensors if n.startswith("blk.0.")]
    top_tensors = [n for n in ref.tensors if not n.startswith("blk.")]
    assert len(block_tensors) == 9 and len(top_tensors) == 3
    assert set(gf.tensors) == set(top_tensors) | {f"blk.{i}.{n}" for i in range(6) for n in block_tensors}
    assert gf.tensors["token_embd.weight"].shape == (N_VOCAB, 288)
    assert gf.tensors["output.weight"].shape == (N_VOCAB, 288)
    assert gf.tensors["blk.5.attn_k.weight"].shape == (288, 288)
    assert gf.tensors["blk.5.ffn_down.weight"].shape == (288, 768)
    assert gf.tensors["blk.5.ffn_gate.weight"].shape == (768, 288)
    assert {t.type for t in gf.tensors.values()} == {QT.F32}
    # llama.cpp's keys with llama.cpp's value types
    for key, mv in ref.meta.items():
        if key.startswith("llama.") or key == "general.architecture":
            assert key in gf.meta and gf.meta[key].type == mv.type, key
    assert gf.get("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert gf.get("llama.rope.freq_base") == 10000.0
    # the tokenizer is the vocabulary file's, key for key
    vocab = load_gguf(SPM_VOCAB)
    assert {k: v for k, v in gf.meta.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in vocab.meta.items() if k.startswith("tokenizer.")}


def test_init_15m_statistics(model_15m):
    gf = load_gguf(model_15m)
    std, residual_std = 0.02, 0.02 / math.sqrt(2 * 6)
    for name in ["token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.3.ffn_up.weight"]:
        w = gf.tensor(name)
        assert abs(w.mean()) < 1e-3 and w.std() == pytest.approx(std, rel=0.02), name
    for name in ["blk.0.attn_output.weight", "blk.5.ffn_down.weight"]:
        assert gf.tensor(name).std() == pytest.approx(residual_std, rel=0.02), name
    for name in ["blk.0.attn_norm.weight", "blk.2.ffn_norm.weight", "output_norm.weight"]:
        assert np.all(gf.tensor(name) == 1.0), name
    # different tensors are drawn independently
    assert not np.allclose(gf.tensor("blk.0.attn_q.weight"), gf.tensor("blk.0.attn_k.weight"))


def test_init_15m_info_shows_24m(model_15m):
    result = run_cli("info", model_15m)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\s*parameters\s+24\.4M\s+24,407,712", result.stdout, re.M), result.stdout


def test_init_15m_loads_as_a_trainable_model(model_15m):

    model = load_model(model_15m)
    assert model.n_params() == 24_407_712


@pytest.mark.determinism
def test_init_is_deterministic(model_15m, tmp_path):
    same = init_model(CONFIG_15M, SPM_VOCAB, tmp_path / "same.gguf", seed=7)
    assert same.read_bytes() == model_15m.read_bytes()
    other = init_model(CONFIG_15M, SPM_VOCAB, tmp_path / "other.gguf", seed=8)
    a, b = load_gguf(model_15m), load_gguf(other)
    assert a.meta == b.meta
    assert not np.array_equal(a.tensor("blk.0.attn_q.weight"), b.tensor("blk.0.attn_q.weight"))


def test_110m_config_shape():

    hp = load_init_config(CONFIG_110M).model.hparams(n_vocab=N_VOCAB)
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_ctx_train) == (768, 12, 12, 12, 2048, 1024)
    n = sum(math.prod(s) for s in (spec.shape for spec in get_family("llama").tensors(hp) if not spec.optional))
    assert n == expected_llama_params(N_VOCAB, 768, 12, 12, 12, 2048) == 134_105_856


def test_init_small_gqa_model_from_a_model_vocab(tmp_path):
    """Any vocabulary source works, and grouped-query shapes follow n_head_kv."""
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\nn_embd = 64\nn_layer = 2\nn_head = 8\nn_head_kv = 2\nn_ff = 96\n[init]\nstd = 0.05\n')
    gf = load_gguf(init_model(config, STORIES, tmp_path / "tiny.gguf"))
    assert gf.get("general.name") == "tiny" and gf.get("llama.context_length") == 2048
    assert gf.tensors["blk.1.attn_k.weight"].shape == (16, 64)
    assert gf.tensor("token_embd.weight").std() == pytest.approx(0.05, rel=0.05)
    assert hparams_of(gf).n_vocab == 512


@pytest.mark.parametrize(
    "text, words",
    [
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\n", "needs n_ff"),
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\nn_ff = 96\nn_embed = 3\n", "unknown key 'n_embed'"),
        ("[model]\nn_embd = '64'\nn_layer = 2\nn_head = 4\nn_ff = 96\n", "n_embd = '64' should be an integer"),
        ("[model]\nn_embd = 64.5\nn_layer = 2\nn_head = 4\nn_ff = 96\n", "should be an integer"),
        ("[model]\nn_embd = 64\nn_layer = 0\nn_head = 4\nn_ff = 96\n", "n_layer must be positive"),
        ("[model]\nn_embd = 60\nn_layer = 2\nn_head = 8\nn_ff = 96\n", "multiple of n_head"),
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\nn_head_kv = 3\nn_ff = 96\n", "multiple of n_head_kv"),
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\nn_ff = 96\nn_rot = 7\n", "n_rot (7) must be even"),
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\nn_ff = 96\n[init]\nstd = -1\n", "std must be positive"),
        ("[model]\nn_embd = 64\nn_layer = 2\nn_head = 4\nn_ff = 96\n[train]\nlr = 1\n", "unknown table(s) train"),
        ("[init]\nstd = 0.02\n", "missing the [model] table"),
        ("[model\nn_embd = 64\n", "invalid TOML"),
    ],
)
def test_init_config_errors(tmp_path, text, words):
    config = tmp_path / "c.toml"
    config.write_text(text)
    with pytest.raises(LlmtuneError) as exc:
        load_init_config(config)
    message = str(exc.value)
    assert message.startswith(f"{config}: ") and words in message and "\n" not in message


def test_init_cli_errors(tmp_path):
    out = tmp_path / "new.gguf"
    result = run_cli("init", "--config", tmp_path / "nope.toml", "--vocab-from", SPM_VOCAB, "-o", out)
    assert_user_error(result, tmp_path / "nope.toml", "no such file")
    bare = write_gguf(tmp_path / "bare.gguf", "llama", {}, [])
    result = run_cli("init", "--config", CONFIG_15M, "--vocab-from", bare, "-o", out)
    assert_user_error(result, bare, "no tokenizer")
    result = run_cli("init", "--config", CONFIG_15M, "--vocab-from", SPM_VOCAB, "-o", out, "--seed", -1)
    assert_user_error(result, "--seed", "0 or more")
    assert not out.exists()


# -- repository entry points -------------------------------------------------------------------


def test_readme_opens_with_the_two_commands():
    head = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert (
        "pip install -e . && llmtune finetune tests/data/stories260K.gguf data/wikitext-100k.txt "
        "--config configs/demo.toml -o out/demo.gguf" in head
    )
    assert 'pip install -e ".[test,mpi]" && python -m pytest -q' in head


def test_ci_script_runs_the_test_command(tmp_path):
    script = REPO / ".ci" / "run"
    text = script.read_text()
    assert script.stat().st_mode & 0o111, ".ci/run must be executable"
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert 'pip install -e ".[test,mpi]" && python -m pytest -q' in text
    # with stand-ins for pip and python on PATH: the script passes on pytest's verdict
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\necho \"pip $*\" >> \"$LOG\"\n")
    (bin_dir / "python").write_text("#!/bin/sh\necho \"$OPENBLAS_CORETYPE python $*\" >> \"$LOG\"\nexit "
                                    "\"$PYTEST_RC\"\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    for pytest_rc in (0, 1):
        log = tmp_path / f"log{pytest_rc}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "PYTEST_RC": str(pytest_rc)}
        result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == pytest_rc, result.stderr
        # then, where the suite passed, the exactness promises again under OpenBLAS's Haswell kernels
        again = [" python -m ruff check .", "Haswell python -m pytest -q -m determinism"] if pytest_rc == 0 else []
        assert log.read_text().splitlines() == ["pip install -e .[test,mpi]", " python -m pytest -q", *again]
