"""--memory-limit (issue 42): the flag on every command, the finetune planner's decisions under a
limit (the frozen matrices' copies, --grad-checkpoint turned on, the refusal), and the FLOP count
MFU is made of, against a hand count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer.main

import llmtune
from cli_helpers import run_cli
from llmtune import cli, resources
from llmtune.backends.cpu import CPUBackend, probes
from llmtune.errors import LlmtuneError
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.quant.qtensor import float_copy_bytes
from llmtune.train import flops, preflight
from llmtune.train.config import FinetuneConfig
from llmtune.train.memory import runtime_bytes
from llmtune.train.trainer import Trainer

STORIES = Path(__file__).parent / "data" / "stories260K.gguf"
RUNTIME = 1 << 30  # the process's runtime, fixed (the planner measures it: Backend.resident_bytes); at 1 GiB
# the limits below are over 1 GiB, so their reserve is 256 MiB (resources.limit_reserve)
COPIES = ("float copies", "packed copies")


@pytest.fixture(autouse=True)
def no_limit(monkeypatch):
    monkeypatch.delenv(resources.MEMORY_LIMIT_ENV, raising=False)
    monkeypatch.setattr(CPUBackend, "resident_bytes", lambda self: RUNTIME)
    monkeypatch.setattr(CPUBackend, "decode_cost", lambda self, qtype: 3.0)  # not measured here
    # float copies, as a build without the packed product keeps (those replace the base's pages)
    monkeypatch.setattr("llmtune.backends.cpu.native.kernels.pack_wt_available", lambda: False)
    monkeypatch.setattr("llmtune.backends.cpu.native.kernels.pack_wt_bytes", lambda shape, transposed=False: 0)
    yield
    resources.set_memory_limit(None)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "stories-q8_0.gguf"
    return load_model(llmtune.export(STORIES, path, "q8_0").out_path)


def _lora_trainer(model, grad_checkpoint=False, n_ctx=64):
    adapter = init_adapter(model, 4, seed=0)
    return Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                   trainable=list(adapter.tensors()), workers=1, grad_checkpoint=grad_checkpoint)


def _need(tr) -> int:
    return sum(v for k, v in tr.memory_bytes().items() if k not in COPIES)


def test_every_command_takes_memory_limit():
    group = typer.main.get_command(cli.app)
    missing = [name for name, cmd in group.commands.items()
               if not any("--memory-limit" in p.opts for p in cmd.params)]
    assert missing == []


def test_a_limit_that_is_not_a_size_is_one_line(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", STORIES, STORIES, "--memory-limit", "lots")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--memory-limit lots: not a size" in err
    monkeypatch.setenv(resources.MEMORY_LIMIT_ENV, "2G")
    resources.set_memory_limit("1.5G")  # the flag wins over the variable, its default
    assert resources.memory_limit() == 3 << 29 and resources.memory_limit_source() == "--memory-limit 1.5G"
    resources.set_memory_limit(None)
    assert resources.memory_limit() == 2 << 30


def test_the_copies_take_what_the_limit_leaves(q8_model):
    """Under a binding limit the float copies take all that the run, its runtime and the reserve
    leave (not half of the free memory), and the plan says how much of them, and what the rest costs."""
    first = _lora_trainer(q8_model)
    need, dense = _need(first), first.copies_wanted
    assert dense == float_copy_bytes({n: w for n, w in q8_model.weights.items() if n != "token_embd.weight"})
    limit = need + runtime_bytes(first) + (256 << 20) + dense // 2  # the reserve: 256 MiB below 5 GiB
    resources.set_memory_limit(str(limit))
    tr = _lora_trainer(q8_model)
    assert tr.float_copies.budget == dense // 2
    lines = preflight.plan_lines(tr, limit, None)
    assert any(f"--memory-limit {limit}" in line for line in lines)
    copies = next(line for line in lines if line.startswith("float copies:"))
    assert "50 %) decoded per product" in copies and "~2.00x slower base products" in copies  # 1 + 0.5 x (3 - 1)


def test_the_limit_turns_grad_checkpoint_on_and_says_so(q8_model):
    plain, ckpt = _lora_trainer(q8_model, n_ctx=128), _lora_trainer(q8_model, grad_checkpoint=True, n_ctx=128)
    assert _need(ckpt) < _need(plain)
    limit = (_need(plain) + _need(ckpt)) // 2 + runtime_bytes(plain) + (256 << 20)
    resources.set_memory_limit(str(limit))
    cfg = FinetuneConfig(ctx=128, batch=128, ubatch=128)
    made = []
    trainer, cfg2, plan = preflight.planned_trainer(
        lambda c: made.append(c.grad_checkpoint) or _lora_trainer(q8_model, c.grad_checkpoint, 128), cfg)
    assert made == [False, True] and cfg2.grad_checkpoint and trainer.grad_checkpoint
    assert cfg2 == dataclasses.replace(cfg, grad_checkpoint=True)
    line = next(p for p in plan if p.startswith("--grad-checkpoint: turned on"))
    assert f"{trainer.flops_per_step / plain.flops_per_step:.2f}x the step's products" in line
    # a limit the run fits without checkpointing leaves it off
    resources.set_memory_limit(str(_need(plain) + runtime_bytes(plain) + (256 << 20)))
    made.clear()
    _, cfg3, _ = preflight.planned_trainer(lambda c: made.append(c) or _lora_trainer(q8_model, c.grad_checkpoint,
                                                                                      128), cfg)
    assert made == [cfg] and not cfg3.grad_checkpoint


def test_what_cannot_fit_even_so_is_refused_in_one_line(q8_model, tmp_path, monkeypatch, capsys):
    tr = _lora_trainer(q8_model, grad_checkpoint=True)
    resources.set_memory_limit(str(_need(tr)))  # the runtime does not fit beside it
    with pytest.raises(LlmtuneError, match=r"is allowed \(--memory-limit \d+\)"):
        preflight.checked_memory(tr, "m.gguf")
    resources.set_memory_limit(None)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little dog. " * 200)
    code, out, err = run_cli(monkeypatch, capsys, "finetune", STORIES, text, "-o", tmp_path / "a.gguf",
                             "--lora-rank", "4", "--ctx", "64", "--epochs", "1", "--memory-limit", "40M")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not fit" in err or "is allowed (--memory-limit 40M)" in err
    assert not (tmp_path / "a.gguf").exists()


def test_the_flop_count_is_the_hand_count():
    """A full finetune of stories260K: the forward's products 2·N·T (N: the matrices multiplied) and
    attention's QK^T and PV (4·T²·d per head), then the input and the weight gradients, twice the
    forward's again; --grad-checkpoint adds the blocks' recomputed products (the q/k/v and gate/up
    products and attention: the outputs the backward reads; attn_output's and ffn_down's are not)."""
    model = load_model(STORIES)
    hp, t = model.hp, 32
    head = hp.n_embd // hp.n_head
    shape = lambda name: model.weights[name].shape  # noqa: E731
    per_layer = {k: shape(f"blk.0.{k}.weight")[0] * shape(f"blk.0.{k}.weight")[1]
                 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    n_mult = hp.n_layer * sum(per_layer.values()) + hp.n_vocab * hp.n_embd  # + the output matrix
    attention = hp.n_layer * 4 * hp.n_head * t * t * head
    forward = 2 * n_mult * t + attention
    tr = Trainer(model, CPUBackend(), n_ctx=t, n_batch=2 * t, n_ubatch=t, trainable=model.select(None))
    assert tr.flops_per_step == 2 * 3 * forward  # two micro-batches a step
    recomputed = 2 * t * hp.n_layer * sum(v for k, v in per_layer.items() if k not in ("attn_output", "ffn_down"))
    tr = Trainer(model, CPUBackend(), n_ctx=t, n_batch=t, n_ubatch=t, trainable=model.select(None),
                 grad_checkpoint=True)
    assert tr.flops_per_step == 3 * forward + recomputed + attention
    assert flops.mfu(tr.flops_per_step, 0.5, 4 * tr.flops_per_step) == 0.5
    assert flops.mfu(tr.flops_per_step, 0.5, None) != flops.mfu(tr.flops_per_step, 0.5, None)  # NaN: no peak



def test_the_rates_are_measured_and_cached(tmp_path, monkeypatch):
    """A stored type's decode cost (the plan's slowdown) is measured once, then read from the cache
    folder, as the BLAS bit-probe is (F16's bytes are stored rows too); the GEMM peak (MFU's
    denominator) is measured at each call and kept as the best seen: a slower measurement (a busy
    machine) does not lower it, a faster one raises it."""
    monkeypatch.setenv("LLMTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probes, "PEAK_SHAPE", (64, 128, 256))
    monkeypatch.setattr(probes, "COST_SHAPE", (64, 256, 128))
    peak, costs = probes.gemm_peak(), {q: probes.decode_cost(q) for q in ("Q8_0", "F16")}
    assert peak > 0 and all(c >= 1.0 for c in costs.values()) and probes.decode_cost("F32") == 1.0
    flops = 2.0 * 64 * 128 * 256
    monkeypatch.setattr(probes, "_best", lambda fn, runs: 2 * flops / peak)  # half as fast: busy
    assert probes.gemm_peak() == peak
    assert {q: probes.decode_cost(q) for q in costs} == costs  # not measured again
    monkeypatch.setattr(probes, "_best", lambda fn, runs: flops / (2 * peak))  # twice as fast
    assert probes.gemm_peak() == pytest.approx(2 * peak)
    monkeypatch.setattr(probes, "_best", lambda fn, runs: 2 * flops / peak)
    assert probes.gemm_peak() == pytest.approx(2 * peak)  # the best seen, kept
