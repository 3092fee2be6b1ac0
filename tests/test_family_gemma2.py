"""gemma2: llama.cpp's recorded perplexity of a random-weight tiny model, llama.cpp's hyper-parameter
defaults, finite-difference gradients through every feature (embedding scale, post-branch norms,
geglu, attention and final softcaps, sliding window on alternate layers), and the commands.

The helpers below (`gemma_gradient_errors`, `run_commands`, `extra_tensor_is_refused`) serve
test_family_gemma3.py too."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import llmtune
from cli_helpers import run_cli
from family_check import check_family
from llmtune.arch import check_tensors, get_family, read_hparams
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf, write_gguf
from llmtune.graph import ops
from llmtune.graph.gradcheck import check_gradients

REPO = Path(__file__).resolve().parents[1]
REPO_CONFIGS = REPO / "configs"
STORIES = REPO / "tests" / "data" / "stories260K.gguf"  # an SPM vocabulary of 512 tokens


# ------------------------------------------------------------------------------ shared helpers
def gemma_gradient_errors(family, hp, seed: int) -> dict[str, float]:
    """Autodiff vs central differences (float64) for every tensor of a tiny model, 2 sequences of 5."""
    rng = np.random.default_rng(seed)
    shapes = {spec.name: spec.shape for spec in family.tensors(hp)}
    arrays = {n.replace(".", "_"): (1.0 + 0.3 * rng.standard_normal(s)) if "norm" in n else 0.5 * rng.standard_normal(s)
              for n, s in shapes.items()}

    def build(tokens, pos, targets, **w):
        logits = family.build(BuildContext(hp, {n: w[n.replace(".", "_")] for n in shapes}, Batch(tokens, pos)))
        return ops.cross_entropy(logits, targets)

    ints = {"tokens": rng.integers(0, hp.n_vocab, (2, 5)), "pos": np.arange(5),
            "targets": rng.integers(0, hp.n_vocab, 10)}
    return check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)


def run_commands(name, tmp_path, monkeypatch, capsys, wiki100k_path):
    """info says supported; a short finetune lowers the loss on its text; export q8_0 runs."""

    model = init_model(REPO_CONFIGS / f"{name}-tiny.toml", STORIES, tmp_path / "m.gguf", seed=1)
    code, out, err = run_cli(monkeypatch, capsys, "info", model)
    assert code == 0 and name in out and "supported" in out and "cannot run" not in out, err
    text = tmp_path / "text.txt"
    text.write_text(wiki100k_path.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    before = llmtune.perplexity(model, text, ctx=64).ppl
    tuned = tmp_path / "tuned.gguf"
    llmtune.finetune(model, text, tuned, ctx=64, batch=256, ubatch=128, epochs=2, lr=3e-3, val_split=0.0)
    after = llmtune.perplexity(tuned, text, ctx=64).ppl
    assert after < 0.9 * before, (before, after)
    q8 = tmp_path / "q8.gguf"
    code, out, err = run_cli(monkeypatch, capsys, "export", tuned, "--type", "q8_0", "-o", q8)
    assert code == 0, err
    assert abs(llmtune.perplexity(q8, text, ctx=64).ppl / after - 1) < 0.02


def extra_tensor_is_refused(model_path, extra: str, tmp_path, monkeypatch, capsys):
    """A file with a tensor the family does not know: one line naming it, exit code 2."""


    gf = load_gguf(model_path)
    tensors = [(n, gf.tensor(n), QT.F32) for n in gf.tensors] + [(extra, gf.tensor("token_embd.weight"), QT.F32)]
    bad = write_gguf(tmp_path / "extra.gguf", gf.arch, dict(gf.meta), tensors)
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", bad, "README.md", "--ctx", 32)
    assert code == 2 and extra in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------ gemma2
def test_gemma2_matches_llama_cpp(tmp_path):
    """Running perplexity of configs/gemma2-tiny.toml (random weights, every tensor) per chunk."""
    check_family("gemma2", tmp_path)


def _gemma2_meta(**keys):
    md = {"general.architecture": "gemma2", "tokenizer.ggml.tokens": ["a"] * 11}
    base = {"context_length": 64, "embedding_length": 8, "block_count": 3, "feed_forward_length": 12,
            "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 6,
            "attention.value_length": 6, "attention.layer_norm_rms_epsilon": 1e-6}
    md.update({f"gemma2.{k}": v for k, v in {**base, **keys}.items()})
    return md


def test_gemma2_hparams_defaults_and_keys():
    """Absent keys take llama.cpp's gemma2 defaults; present ones are read; q scale 1/sqrt(key_length)."""
    hp = read_hparams(_gemma2_meta())
    assert (hp.attn_softcap, hp.final_softcap, hp.sliding_window, hp.rope_freq_base) == (50.0, 30.0, 4096, 10000.0)
    assert hp.swa_layers == (True, False, True) and hp.tied_output and hp.rope_mode == "neox"
    assert hp.kq_scale == pytest.approx(1 / np.sqrt(6)) and hp.n_rot == 6
    window = {"attention.sliding_window": 7, "attention.sliding_window_pattern": [False, True, True]}
    hp = read_hparams(_gemma2_meta(attn_logit_softcapping=20.0, final_logit_softcapping=10.0, **window))
    assert (hp.attn_softcap, hp.final_softcap, hp.sliding_window, hp.swa_layers) == (20.0, 10.0, 7, (False, True, True))
    assert [hp.is_swa(i) for i in range(3)] == [False, True, True]
    # the 27B shape (46 layers) scales queries by 1/sqrt(n_embd / n_head), as gemma_pytorch does
    assert read_hparams(_gemma2_meta(block_count=46)).kq_scale == pytest.approx(1 / 2.0)


def test_gemma2_init_writes_the_converter_keys(tmp_path):

    gf = load_gguf(init_model(REPO_CONFIGS / "gemma2-tiny.toml", STORIES, tmp_path / "g.gguf"))
    keys = {k[len("gemma2."):] for k in gf.metadata if k.startswith("gemma2.")}
    assert keys == {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
                    "attention.value_length", "attn_logit_softcapping", "final_logit_softcapping",
                    "attention.sliding_window"}
    assert "output.weight" not in gf.tensors and "blk.1.post_ffw_norm.weight" in gf.tensors


def test_gemma2_gradients():
    """Finite differences through 2 layers (one local with a 2-token window, one global), both softcaps."""
    family = get_family("gemma2")
    hp = family.make_hparams(n_vocab=11, n_ctx_train=16, n_embd=6, n_layer=2, n_head=2, n_head_kv=1, n_ff=6,
                             n_rot=4, head_dim_kq=4, sliding_window=2, attn_softcap=1.5, final_softcap=2.0)
    assert hp.swa_layers == (True, False) and hp.tied_output
    errors = gemma_gradient_errors(family, hp, seed=7)
    assert max(errors.values()) < 1e-5, errors


def test_gemma2_commands(tmp_path, monkeypatch, capsys, wiki100k_path):
    run_commands("gemma2", tmp_path, monkeypatch, capsys, wiki100k_path)


def test_gemma2_unknown_tensor_is_refused(tmp_path, monkeypatch, capsys):
    """llama.cpp never loads a gemma2 output.weight (the output is token_embd): neither does llmtune."""

    model = init_model(REPO_CONFIGS / "gemma2-tiny.toml", STORIES, tmp_path / "g.gguf")
    extra_tensor_is_refused(model, "output.weight", tmp_path, monkeypatch, capsys)
    hp = get_family("gemma2").make_hparams(n_vocab=11, n_ctx_train=16, n_embd=6, n_layer=1, n_head=2, n_head_kv=1,
                                           n_ff=6, n_rot=4, head_dim_kq=4)
    shapes = {s.name: s.shape for s in get_family("gemma2").tensors(hp)}
    del shapes["blk.0.post_ffw_norm.weight"]
    with pytest.raises(LlmtuneError, match="missing tensor blk.0.post_ffw_norm.weight"):
        check_tensors(hp, shapes, "x.gguf")
