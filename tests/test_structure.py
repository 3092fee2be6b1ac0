"""The package's shape: no import circles, and a new architecture family is one module."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import toy_family
from cli_helpers import run_cli
from llmtune.arch import get_family, supported
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.graph import ops
from llmtune.graph.gradcheck import check_gradients

PACKAGE = Path(__file__).resolve().parents[1] / "llmtune"


# ------------------------------------------------------------------------------ import graph
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the llmtune modules it imports anywhere in its text (lazy imports included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_package_imports_have_no_circles():
    graph = import_graph()
    assert len(graph) > 30 and "llmtune.arch.llama" in graph["llmtune.model.loaded"] | graph["llmtune.arch"] | {"llmtune.arch.llama"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_top_level_folders_are_one_concern_each():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["arch", "backends", "convert", "eval", "gguf", "graph", "model", "native", "quant", "tokenizer",
                       "train", "ui"]
    # the engine knows no model, the library no terminal
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith(("llmtune.graph", "llmtune.backends", "llmtune.native")):
            assert not any(e.startswith(("llmtune.arch", "llmtune.model", "llmtune.train")) for e in edges), name
        if name.startswith(("llmtune.train", "llmtune.eval", "llmtune.convert", "llmtune.model", "llmtune.arch")):
            assert not any(e.startswith("llmtune.ui") or e == "llmtune.cli" for e in edges), name


# ------------------------------------------------------------------------------ a new family in one module
TOY_CONFIG = """[model]
architecture = "toy-qkv-bias"
n_ctx = 64
n_embd = 32
n_layer = 2
n_head = 4
n_head_kv = 2
n_ff = 48
"""


@pytest.fixture()
def toy_model(tmp_path, stories_path):
    from llmtune.convert.init import init_model

    config = tmp_path / "toy.toml"
    config.write_text(TOY_CONFIG)
    return init_model(config, stories_path, tmp_path / "toy.gguf", seed=1)


def test_toy_family_is_registered_by_its_module_alone():
    assert "toy-qkv-bias" in supported() and "llama" in supported()
    assert isinstance(get_family("toy-qkv-bias"), toy_family.LlamaQKVBias)


def test_toy_family_runs_every_command(tmp_path, toy_model, wiki100k_path, monkeypatch, capsys):
    from llmtune.gguf import load_gguf
    from llmtune.model.loaded import load_model

    gf = load_gguf(toy_model)
    assert gf.tensors["blk.1.attn_k.bias"].shape == (16,) and gf.get("general.architecture") == "toy-qkv-bias"
    code, out, err = run_cli(monkeypatch, capsys, "info", toy_model)
    assert code == 0 and "supported" in out and "cannot run" not in out, err
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", toy_model, wiki100k_path, "--ctx", 32, "--chunks", 2)
    assert code == 0 and "Final estimate: PPL" in out, err
    tuned = tmp_path / "tuned.gguf"
    code, out, err = run_cli(monkeypatch, capsys, "finetune", toy_model, wiki100k_path, "-o", tuned, "--ctx", 32,
                             "--epochs", 1, "--lr", 1e-2, "--params", r"attn_q\.bias", "--val-split", 0.5)
    assert code == 0, err
    trained = load_model(tuned).weights["blk.0.attn_q.bias"]
    assert np.abs(trained).max() > 0  # biases start at zero: they moved, so the graph used them
    mmlu = Path(__file__).parent / "data" / "benchmarks" / "mmlu-20.jsonl"
    code, out, err = run_cli(monkeypatch, capsys, "eval", toy_model, mmlu, "--summary")
    assert code == 0 and "Final result:" in out, err


def test_toy_family_biases_enter_the_graph_and_its_gradients(toy_model):
    """Zero biases give llama's logits for the same matrices; non-zero ones change them, and
    finite differences confirm the biases' gradients (float64)."""
    from llmtune.model.loaded import load_model

    model = load_model(toy_model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.hp.n_vocab, (1, 6)).astype(np.int32)
    feed = {"tokens": tokens, "pos": np.arange(6, dtype=np.int32)}

    def logits_of(family_name, weights):
        hp = get_family(family_name).make_hparams(**{k: v for k, v in vars(model.hp).items() if k != "arch"})
        from llmtune.graph.planner import Program

        nodes = {n: ops.param(w.shape, name=n, requires_grad=False) for n, w in weights.items()}
        batch = Batch.make(1, 6)
        logits = get_family(family_name).build(BuildContext(hp, nodes, batch))
        be = CPUBackend(np.float64)
        return Program([logits], be, params={nodes[n]: np.asarray(w, np.float64) for n, w in weights.items()}).run(**feed)[0].copy()

    plain = {n: w for n, w in model.weights.items() if not n.endswith(".bias")}
    np.testing.assert_allclose(logits_of("toy-qkv-bias", model.weights), logits_of("llama", plain), rtol=1e-12, atol=1e-12)
    biased = dict(model.weights, **{"blk.0.attn_v.bias": rng.standard_normal(16)})
    assert not np.allclose(logits_of("toy-qkv-bias", biased), logits_of("llama", plain))



def test_toy_family_gradients_through_the_biases():
    """Finite differences (float64) through a tiny toy model, biases and all."""
    family = get_family("toy-qkv-bias")
    hp = family.make_hparams(n_vocab=11, n_ctx_train=16, n_embd=8, n_layer=2, n_head=4, n_head_kv=2, n_ff=12, n_rot=2)
    rng = np.random.default_rng(5)
    shapes = {spec.name: spec.shape for spec in family.tensors(hp) if not spec.optional}
    assert "blk.1.attn_v.bias" in shapes
    arrays = {n.replace(".", "_"): rng.standard_normal(s) * (1.0 if "norm" in n else 0.4) for n, s in shapes.items()}

    def build(tokens, pos, targets, **w):
        logits = family.build(BuildContext(hp, {n: w[n.replace(".", "_")] for n in shapes}, Batch(tokens, pos)))
        return ops.cross_entropy(logits, targets)

    ints = {"tokens": rng.integers(0, 11, (2, 4)), "pos": np.arange(4), "targets": rng.integers(0, 11, 8)}
    errors = check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)
    assert max(errors.values()) < 1e-5, errors
