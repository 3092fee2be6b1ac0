"""`llmtune init` streams: each tensor is drawn, encoded and written a piece of rows at a time
(gguf/file.py write_gguf_streamed), so its memory does not grow with the model; `--type` writes
what `init` then `export --type` would, byte for byte."""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from rich.console import Console

import llmtune.convert.init as init
from cli_helpers import run_cli
from llmtune.convert.export import export
from llmtune.convert.init import init_layout, init_model, load_init_config
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import TensorSlot, load_gguf, write_gguf_streamed
from llmtune.quant.plan import export_type
from llmtune.ui.progress import tensor_progress

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
SPM_VOCAB = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
QWEN2_VOCAB = DATA / "vocab" / "ggml-vocab-qwen2.gguf.gz"

# sha256 of the files `init` wrote before it streamed (the tree of commit d0fe606, which held every
# tensor until it wrote): (config, vocabulary, seed, test_weights/optional) -> digest
BEFORE_STREAMING = {
    "15m": ("configs/llama-15m.toml", SPM_VOCAB, 7, {},
            "5e533c0a056a3530884357042433285c119292a0460c1fb5857c4e684d9d95fa"),
    "qwen2-tiny": ("configs/qwen2-tiny.toml", STORIES, 3, {},
                   "353ae30015c4d1a4642cdf04a76b2c8e4f1a322b07e92824c911cf2d16bd89fd"),
    "llama3-tiny test weights": ("configs/llama3-tiny.toml", STORIES, 5,
                                 {"test_weights": True, "optional": ("rope_freqs.weight",)},
                                 "8b413842cdfe7fc7abf07a8498bb36b66e9a28ea66988633d17232d847dfcca3"),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def wide_config(tmp_path) -> Path:
    """Rows of 256: every K-quant applies without llama.cpp's fallbacks; 8 layers: the _M mixes vary."""
    config = tmp_path / "w256.toml"
    config.write_text("[model]\nn_embd = 256\nn_layer = 8\nn_head = 4\nn_ff = 512\nn_ctx = 128\n")
    return config


@pytest.mark.determinism
@pytest.mark.parametrize("piece", [None, 1000], ids=["default pieces", "pieces of 1000 values"])
@pytest.mark.parametrize("case", list(BEFORE_STREAMING))
def test_streamed_init_writes_the_file_init_wrote_before(case, piece, tmp_path, monkeypatch):
    """The random stream and the layout are unchanged, however small the pieces."""
    config, vocab, seed, options, digest = BEFORE_STREAMING[case]
    if piece is not None:
        monkeypatch.setattr(init, "PIECE_ELEMENTS", piece)
    out = init_model(REPO / config, vocab, tmp_path / "m.gguf", seed=seed, **options)
    assert _sha256(out) == digest


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k_m", "f16"])
@pytest.mark.parametrize("config", ["wide", "qwen2-tiny"])
def test_init_type_is_init_then_export(type_name, config, wide_config, tmp_path, monkeypatch):
    """init --type TYPE == init, then export --type TYPE: the same tensor types (llama.cpp's mixes
    and fallbacks, 64-wide rows fall back), metadata and bytes, with each tensor quantized in pieces."""
    config = wide_config if config == "wide" else REPO / "configs" / "qwen2-tiny.toml"
    f32 = init_model(config, STORIES, tmp_path / "f32.gguf", seed=4)
    exported = export(f32, tmp_path / "exported.gguf", type_name).out_path
    monkeypatch.setattr(init, "PIECE_ELEMENTS", 700)  # blocks of rows, not whole tensors
    direct = init_model(config, STORIES, tmp_path / "direct.gguf", seed=4, type=type_name)
    assert direct.read_bytes() == exported.read_bytes()
    assert len({t.type for t in load_gguf(direct).tensors.values()}) > 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt, LlmtuneError])
def test_a_stopped_init_leaves_no_file(stop, wide_config, tmp_path):
    """Ctrl-C (or any error) in the middle of the tensors: no partial file, no temp file, and an
    earlier file at -o as it was."""
    out = tmp_path / "out" / "m.gguf"

    def stop_at_the_third(done, total, name):
        if done == 3:
            raise stop("stop")

    with pytest.raises(stop):
        init_model(wide_config, STORIES, out, type="q4_k_m", progress=stop_at_the_third)
    assert list(out.parent.iterdir()) == []
    earlier = init_model(wide_config, STORIES, out, seed=1)
    before = earlier.read_bytes()
    with pytest.raises(stop):
        init_model(wide_config, STORIES, out, seed=2, progress=stop_at_the_third)
    assert list(out.parent.iterdir()) == [out] and out.read_bytes() == before


def test_the_streamed_writer_refuses_pieces_that_do_not_fill_a_tensor(tmp_path):
    slot = TensorSlot("w", (4, 32), QT.F32)
    with pytest.raises(ValueError, match="tensor 'w': 256 bytes of data, its header says 512"):
        write_gguf_streamed(tmp_path / "m.gguf", "llama", {}, [slot], lambda s: [np.zeros((2, 32), np.float32)])
    assert list(tmp_path.iterdir()) == []


def _traced_peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_streamed_init_holds_one_piece_not_the_model(tmp_path, monkeypatch):
    """numpy's allocations (tracemalloc sees them) do not grow with the model: a model of 3x the
    tensors peaks about as high as a small one, at about one tensor (f32, pieces as big as the tensors
    here) or, with pieces of 16K values, below one tensor whatever the type (the quantizers'
    scratch grows with the piece up to their own chunk, 512 blocks)."""
    configs = {}
    for n_layer in (2, 6):
        configs[n_layer] = tmp_path / f"deep{n_layer}.toml"
        configs[n_layer].write_text(f"[model]\nn_embd = 256\nn_layer = {n_layer}\nn_head = 4\nn_ff = 1024\n")
    hp = load_init_config(configs[6]).model.hparams(n_vocab=512)
    sizes = [4 * math.prod(spec.shape) for spec in init.init_specs(hp)]
    largest = max(sizes)  # ffn: 1 MiB of float32, in a model of 16 MiB
    assert sum(sizes) > 15 * largest

    def peak(n_layer, type_name):
        return _traced_peak(lambda: init_model(configs[n_layer], STORIES, tmp_path / "m.gguf", type=type_name))

    peak(2, "f32")  # numpy.random and friends imported before tracing
    assert peak(6, "f32") < 1.25 * largest
    monkeypatch.setattr(init, "PIECE_ELEMENTS", 16384)  # 64 KiB of float32
    for type_name in ("f32", "q8_0", "q4_k_m"):
        small, big = peak(2, type_name), peak(6, type_name)
        # 4 more layers: 13 MiB more weights, a few KiB more header, slots and plans
        assert big - small < largest / 8 and big < largest, (type_name, small, big, largest)


@pytest.fixture(scope="module")
def qwen2_vocab(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "ggml-vocab-qwen2.gguf"
    path.write_bytes(gzip.decompress(QWEN2_VOCAB.read_bytes()))
    return path


def test_the_7b_shape_needs_one_piece_of_memory_and_its_file_of_disk(qwen2_vocab, tmp_path, monkeypatch):
    """configs/qwen2-7b.toml (7.6B parameters, 30 GB as float32) is checked against what streaming
    holds (a piece and the header, well under 100 MiB) and against its file's size on disk."""
    config_path = REPO / "configs" / "qwen2-7b.toml"
    config = load_init_config(config_path)
    hp, meta, slots = init_layout(config_path, config, qwen2_vocab, export_type("q4_k_m"))
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab) == (3584, 28, 28, 4, 18944, 151936)
    assert "blk.0.attn_q.bias" in {s.name for s in slots} and not hp.tied_output
    n_params = sum(math.prod(s.shape) for s in slots)
    assert n_params == 7_614_699_008
    file_bytes = sum(s.n_bytes for s in slots)
    assert 4.2 * 2**30 < file_bytes < 4.8 * 2**30  # llama.cpp's Q4_K_M of Qwen2-7B: 4.36 GiB
    monkeypatch.setattr(init, "available_memory", lambda: 100 * 2**20)
    monkeypatch.setattr("llmtune.resources.free_disk", lambda folder: 2**40)
    init._check_resources(config_path, tmp_path / "7b.gguf", slots, meta, "q4_k_m")  # fits
    monkeypatch.setattr(init, "available_memory", lambda: 20 * 2**20)
    with pytest.raises(LlmtuneError, match=r"7,614,699,008 parameters needs about \d\d MiB of memory \(the header "
                                           r"and 1,170 rows of output.weight as Q6_K\) but only 20 MiB is available$"):
        init._check_resources(config_path, tmp_path / "7b.gguf", slots, meta, "q4_k_m")
    monkeypatch.setattr(init, "available_memory", lambda: None)
    monkeypatch.setattr("llmtune.resources.free_disk", lambda folder: 2**30)
    with pytest.raises(LlmtuneError, match=r"parameters \(q4_k_m\) need about 4,\d{3} MiB of disk space but only "
                                           r"1,024 MiB is free"):
        init._check_resources(config_path, tmp_path / "7b.gguf", slots, meta, "q4_k_m")


def test_init_type_on_the_command_line(wide_config, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "init", "--config", wide_config, "--vocab-from", STORIES,
                             "-o", tmp_path / "q.gguf", "--type", "q8_0")
    assert code == 0 and err == "" and "(q8_0), seed 0" in out, (out, err)
    assert load_gguf(tmp_path / "q.gguf").tensors["blk.0.ffn_up.weight"].type == QT.Q8_0
    code, out, err = run_cli(monkeypatch, capsys, "init", "--config", wide_config, "--vocab-from", STORIES,
                             "-o", tmp_path / "x.gguf", "--type", "q3")
    assert code == 2 and err.strip().endswith("--type q3: unknown type (choose from f32, f16, bf16, q8_0, q4_0, "
                                              "q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m, q5_k_m)"), err
    assert not (tmp_path / "x.gguf").exists()


def test_tensor_progress_off_a_terminal_prints_a_line_now_and_then():
    """A log gets a line at most every `line_every` seconds: none from a short run."""
    for every, lines in ((30.0, 0), (0.0, 3)):
        buf = io.StringIO()
        with tensor_progress(Console(file=buf, force_terminal=False), "init q4_k_m", line_every=every) as on_tensor:
            for i, name in enumerate(["a.weight", "b.weight", "c.weight"], 1):
                on_tensor(i, 3, name)
        assert len(buf.getvalue().splitlines()) == lines, buf.getvalue()
    assert buf.getvalue().splitlines()[1].startswith("init q4_k_m: 2/3 tensors written (b.weight), ")
