"""llmtune perplexity: llama.cpp's numbers, KL-divergence, batching, JSON output and CLI errors."""

import gzip
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from llmtune.backends.cpu import CPUBackend
from llmtune.backends.cpu.threads import blas_threads
from llmtune.errors import LlmtuneError
from llmtune.eval.perplexity import perplexity, perplexity_from_ids, token_nll
from llmtune.gguf.file import MetaValue, load_gguf, write_gguf
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model

DATA = Path(__file__).parent / "data"
STORIES = DATA / "stories260K.gguf"
WIKI_GZ = DATA / "wikitext-2-raw-test.txt.gz"
REFERENCE = json.loads((DATA / "llamacpp-ppl-c128.json").read_text())["128"]


@pytest.fixture(scope="module")
def stories():
    return load_model(STORIES)


@pytest.fixture(scope="module")
def ids():
    return np.load(DATA / "wikitext-2-raw-test.stories260K.ids.npz")["ids"].astype(np.int32)


@pytest.fixture(scope="module")
def ref_run(stories, ids):
    return perplexity_from_ids(stories, ids, ctx=128, chunks=40)


def test_running_values_match_llamacpp(ref_run):
    # llama-perplexity -c 128 -b 128 --chunks 40 on stories260K
    got, want = np.array(ref_run.chunks), np.array(REFERENCE["chunks"])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-3)
    assert ref_run.ppl == pytest.approx(REFERENCE["final"], rel=1e-3)
    assert ref_run.ppl_err == pytest.approx(REFERENCE["err"], rel=1e-3)
    assert ref_run.n_tokens == 40 * 128 and ref_run.n_scored == 40 * 63
    assert ref_run.tokens_per_s > 0 and ref_run.kl is None


def test_whole_file_matches_llamacpp(stories, ids):
    # llama-perplexity -c 128 over all 6458 chunks: PPL = 154.7236 +/- 1.02369
    res = perplexity_from_ids(stories, ids, ctx=128)
    assert len(res.chunks) == ids.size // 128 == 6458
    assert res.ppl == pytest.approx(154.7236, rel=1e-4)
    assert res.ppl_err == pytest.approx(1.02369, rel=1e-3)


def test_scores_second_half_of_each_chunk(stories, ids):
    """Independent float64 recomputation of two chunks from full logits, BOS at each chunk start."""
    ctx = 16
    logits = _full_logits(stories, ids, ctx, n_chunks=2)
    nll = []
    for c in range(2):
        chunk = ids[c * ctx:(c + 1) * ctx]
        for j in range(ctx // 2, ctx - 1):
            row = logits[c, j].astype(np.float64)
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[chunk[j + 1]])
    res = perplexity_from_ids(stories, ids, ctx=ctx, chunks=2)
    assert res.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    assert res.chunks[0] == pytest.approx(math.exp(np.mean(nll[:ctx - 1 - ctx // 2])), rel=1e-5)
    sd = math.sqrt((np.mean(np.square(nll)) - np.mean(nll) ** 2) / (len(nll) - 1))
    assert res.ppl_err == pytest.approx(res.ppl * sd, rel=1e-4)


def _full_logits(model, ids, ctx, n_chunks):
    """Logits of every position (logits_start=0), tokens with BOS at each chunk start."""

    backend = CPUBackend()
    _, nodes, logits = model.build(n_chunks, ctx)
    prog = Program([logits], backend, params={nodes[n]: w for n, w in model.weights.items()})
    tokens = ids[:n_chunks * ctx].reshape(n_chunks, ctx).copy()
    tokens[:, 0] = 1
    (out,) = prog.run(tokens=tokens, pos=np.arange(ctx, dtype=np.int32))
    return np.array(out).reshape(n_chunks, ctx, -1)


def test_batch_larger_than_ctx_gives_same_numbers(stories, ids):
    one = perplexity_from_ids(stories, ids, ctx=64, chunks=10, batch=64)
    several = perplexity_from_ids(stories, ids, ctx=64, chunks=10, batch=256)  # 4 + 4 + 2 chunks per pass
    below = perplexity_from_ids(stories, ids, ctx=64, chunks=10, batch=16)  # still one chunk per pass
    np.testing.assert_allclose(several.chunks, one.chunks, rtol=1e-6)
    np.testing.assert_allclose(below.chunks, one.chunks, rtol=1e-6)
    assert several.ppl_err == pytest.approx(one.ppl_err, rel=1e-6)


@pytest.mark.determinism
def test_workers_give_same_numbers_and_restore_blas_threads(stories, ids):

    if not blas_threads.available():
        pytest.skip("numpy's BLAS is not OpenBLAS: one worker only")
    get_threads = blas_threads._load()[0]
    before = get_threads()
    one = perplexity_from_ids(stories, ids, ctx=64, chunks=12, batch=128, workers=1)
    three = perplexity_from_ids(stories, ids, ctx=64, chunks=12, batch=128, workers=3)  # 6 passes, 3 threads
    np.testing.assert_allclose(three.chunks, one.chunks, rtol=1e-6)
    assert get_threads() == before


def test_kl_of_model_with_itself_is_zero(stories, ids, ref_run):
    res = perplexity_from_ids(stories, ids, ctx=128, chunks=8, kl_base=stories)
    assert res.kl == 0.0 and res.kl_max == 0.0 and res.kl_err == 0.0
    assert res.same_top == 1.0
    assert res.ppl_base == res.ppl == pytest.approx(ref_run.chunks[7], rel=1e-9)


def test_kl_against_perturbed_model(stories, ids):
    """KL(base || model) and top-token agreement checked against a float64 recomputation."""
    ctx, n = 32, 3
    noisy = load_model(STORIES)
    rng = np.random.default_rng(0)
    for name in ("output.weight", "blk.4.ffn_down.weight"):
        w = noisy.weights[name]  # weights are read-only views of the file: replace, don't mutate
        noisy.weights[name] = w + rng.normal(0, 0.5 * w.std(), w.shape).astype(np.float32)
    res = perplexity_from_ids(noisy, ids, ctx=ctx, chunks=n, kl_base=stories, batch=ctx)  # a pass per chunk
    first = ctx // 2
    base = _full_logits(stories, ids, ctx, n)[:, first:ctx - 1].astype(np.float64)
    model = _full_logits(noisy, ids, ctx, n)[:, first:ctx - 1].astype(np.float64)

    def logp(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lb, lm = logp(base), logp(model)
    kl = (np.exp(lb) * (lb - lm)).sum(axis=-1)
    assert res.kl > 0.01
    assert res.kl == pytest.approx(kl.mean(), rel=1e-4)
    assert res.kl_max == pytest.approx(kl.max(), rel=1e-4)
    assert res.same_top == pytest.approx(np.mean(lb.argmax(-1) == lm.argmax(-1)))
    assert 0 < res.same_top < 1
    assert res.ppl_base == pytest.approx(perplexity_from_ids(stories, ids, ctx=ctx, chunks=n, batch=ctx).ppl, rel=1e-9)


def test_text_file_is_tokenized_like_llamacpp(stories, ids):
    res = perplexity(STORIES, WIKI_GZ, ctx=128, chunks=3)
    want = perplexity_from_ids(stories, ids, ctx=128, chunks=3)
    # with --chunks only the chunks' tokens are read (an SPM text stops early, exactly)
    assert res.chunks == want.chunks and 3 * 128 <= res.n_text_tokens < ids.size


def test_library_errors(stories, ids, tmp_path):
    with pytest.raises(LlmtuneError, match="needs at least 256"):
        perplexity_from_ids(stories, ids[:255], ctx=128)
    with pytest.raises(LlmtuneError, match="--ctx"):
        perplexity_from_ids(stories, ids, ctx=2)
    with pytest.raises(LlmtuneError, match="--chunks"):
        perplexity_from_ids(stories, ids, ctx=64, chunks=0)
    with pytest.raises(LlmtuneError, match="outside the vocabulary"):
        perplexity_from_ids(stories, np.full(300, 600), ctx=64)
    with pytest.raises(LlmtuneError, match="nope.txt: no such file"):
        perplexity(STORIES, tmp_path / "nope.txt", ctx=64)


# --- command line --------------------------------------------------------------------------------


def _run_cli(monkeypatch, capsys, *args):
    return run_cli(monkeypatch, capsys, "perplexity", *args)


def _one_line_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def test_cli_prints_llamacpp_lines_and_writes_json(monkeypatch, capsys, tmp_path, ref_run):
    out_json = tmp_path / "res" / "ppl.json"
    code, out, _ = _run_cli(monkeypatch, capsys, STORIES, WIKI_GZ, "--ctx", "128", "--chunks", "6",
                            "--batch", "512", "--json", out_json)
    assert code == 0
    running = re.search(r"^((\[\d+\][\d.]+,)+)$", out, re.M).group(1)  # llama-perplexity's "[1]97.6015,[2]..."
    shown = [float(v) for v in re.findall(r"\[\d+\]([\d.]+),", running)]
    # the 4th decimal as printed: --batch 512 and the reference's batch sum in other orders
    np.testing.assert_allclose(shown, ref_run.chunks[:6], rtol=0, atol=1.5e-4)
    data = json.loads(out_json.read_text())
    assert f"Final estimate: PPL = {data['ppl']:.4f} +/- {data['ppl_err']:.5f}" in out
    np.testing.assert_allclose(data["chunks"], ref_run.chunks[:6], rtol=1e-6)
    assert data["n_tokens"] == 6 * 128 and data["tokens_per_s"] > 0 and data["ctx"] == 128
    assert "kl" not in data


def test_cli_kl_base_json(monkeypatch, capsys, tmp_path):
    out_json = tmp_path / "kl.json"
    code, out, _ = _run_cli(monkeypatch, capsys, STORIES, WIKI_GZ, "--ctx", "64", "--chunks", "2",
                            "--kl-base", STORIES, "--json", out_json)
    assert code == 0 and "Mean    KLD:   0.000000" in out and "Same top p: 100.000" in out
    data = json.loads(out_json.read_text())
    assert data["kl"] == 0.0 and data["same_top"] == 1.0 and data["ppl_base"] == data["ppl"]


def test_cli_missing_text(monkeypatch, capsys, tmp_path):
    code, _, err = _run_cli(monkeypatch, capsys, STORIES, tmp_path / "missing.txt")
    _one_line_error(code, err, "missing.txt: no such file")


def test_cli_text_too_short(monkeypatch, capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a little girl. " * 20)
    code, _, err = _run_cli(monkeypatch, capsys, STORIES, short, "--ctx", "512")
    _one_line_error(code, err, "short.txt", "needs at least 1024")


def test_cli_kl_base_vocab_mismatch(monkeypatch, capsys, tmp_path):
    other = _stories_with_other_vocab(tmp_path / "other-vocab.gguf")
    code, _, err = _run_cli(monkeypatch, capsys, STORIES, WIKI_GZ, "--ctx", "64", "--chunks", "2", "--kl-base", other)
    _one_line_error(code, err, "other-vocab.gguf", "vocabulary")


def test_cli_json_never_overwrites_input(monkeypatch, capsys, tmp_path):
    text = tmp_path / "wiki.txt"
    text.write_bytes(gzip.decompress(WIKI_GZ.read_bytes())[:20000])
    before = text.read_bytes()
    code, _, err = _run_cli(monkeypatch, capsys, STORIES, text, "--ctx", "64", "--json", text)
    _one_line_error(code, err, "wiki.txt", "refusing to overwrite")
    assert text.read_bytes() == before


def _stories_with_other_vocab(path: Path) -> Path:
    """stories260K with two token strings swapped: same size, different vocabulary."""
    gf = load_gguf(STORIES)
    meta = dict(gf.meta)
    old = meta["tokenizer.ggml.tokens"]
    tokens = list(old.value)
    tokens[300], tokens[301] = tokens[301], tokens[300]
    meta["tokenizer.ggml.tokens"] = MetaValue(tokens, old.type, old.sub_type)
    tensors = [(name, gf.tensor(name), info.type) for name, info in gf.tensors.items()]
    return write_gguf(path, gf.arch, meta, tensors)


@pytest.mark.parametrize("offset", [0.0, 120.0, -120.0])
def test_token_nll_exact_for_extreme_logits(offset):
    """Rows far from 0 take the shifted exp path; both paths agree with float64."""

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 5, 1000)) * 4 + offset).astype(np.float32)
    targets = rng.integers(0, 1000, (3, 5))
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    want = np.log(np.exp(x - m).sum(axis=-1)) + m[..., 0] - np.take_along_axis(x, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(token_nll(logits.copy(), targets), want, rtol=1e-6, atol=1e-6)
