"""Batched decoding (eval/generate.py BatchGenerator): G prompts of different lengths generated
together give, per prompt, exactly the tokens of generating it alone (greedy: f32 and quantized
weights, the compiled decode step and the numpy kernels, the CUDA kernels under the emulator), each
sequence stops on its own, and seeded sampling is reproducible with one random stream per sequence."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

import cuda_emu
from cli_helpers import run_cli
from llmtune.backends import cuda
from llmtune.backends.cpu import CPUBackend
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cuda import CUDABackend
from llmtune.convert.export import export
from llmtune.eval.generate import BatchGenerator, Generator, batch_samplers
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.model.loaded import load_model

PROMPTS = ["Once upon a time", "The cat", "Lily went to the park and saw a big red ball. She", "One day"]


@pytest.fixture(scope="module")
def stories(stories_path):
    return load_model(stories_path)


@pytest.fixture(scope="module")
def stories_q8(stories_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("batched") / "stories-q8_0.gguf"
    export(stories_path, out, "Q8_0")
    return load_model(out)


def alone(model, ids, n, cfg, backend="cpu", n_ctx=256) -> list[int]:
    gen = Generator(model, backend, n_ctx=n_ctx)
    return gen.generate(ids, n, Sampler(cfg)).tokens


def _ids(model):
    tok = Generator(model, n_ctx=8).tokenize_prompt
    ids = [tok(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # every prompt a different length
    return ids


# (quantized, LLMTUNE_NATIVE). Not (True, "0"): numpy's BLAS rounds a 4-row product and a 1-row one
# differently (logits ~3e-7 apart, test_batched_logits_are_each_sequence_alone), and the Q8_0
# rounding of the activations amplifies that into a different pick at a near tie (a 0.006 margin,
# token 23 of the third prompt); the compiled products (the default) are bit for bit per row
@pytest.mark.parametrize("quantized,native_on", [(False, "1"), (False, "0"), (True, "1")])
def test_greedy_batch_is_each_prompt_alone(stories, stories_q8, quantized, native_on, monkeypatch):
    """G = 4 prompts of different lengths, 32 tokens: each sequence's tokens are its own greedy
    generation's, with the compiled decode step (one program for the whole cache) and without."""
    monkeypatch.setenv("LLMTUNE_NATIVE", native_on)
    kernels.reset()
    try:
        model = stories_q8 if quantized else stories
        ids = _ids(model)
        greedy = SamplerConfig(temp=0.0, seed=0)
        want = [alone(model, i, 32, greedy) for i in ids]
        gen = BatchGenerator(model, n_seq=4, n_ctx=256)
        got = gen.generate_batch(ids, 32)
        assert [r.tokens for r in got] == want
        assert all(r.stop == "length" and r.prompt_tokens == i for r, i in zip(got, ids))
        decode = {key for key in gen._programs._programs if key[2] is None}
        if native_on == "1" and kernels.available():
            assert decode == {(1, 256, None)}  # the compiled batched step: one program
    finally:
        kernels.reset()


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("quantized", [False, True])
def test_batched_logits_are_each_sequence_alone(stories, stories_q8, quantized, native_on, monkeypatch):
    """The prefill's logits are the one-sequence prefill's bit for bit; the decode step's per row
    the one-sequence step's to float rounding (the compiled Q8_0 products: bit for bit)."""
    monkeypatch.setenv("LLMTUNE_NATIVE", native_on)
    kernels.reset()
    try:
        model = stories_q8 if quantized else stories
        ids = _ids(model)
        gen = BatchGenerator(model, n_seq=4, n_ctx=128)
        first = np.stack([gen.prefill(b, i) for b, i in enumerate(ids)])
        nxt = first.argmax(-1)
        got = gen.step_all(nxt, [len(i) for i in ids])
        exact = quantized and native_on == "1" and kernels.available()
        for b, i in enumerate(ids):
            one = Generator(model, n_ctx=128)
            np.testing.assert_array_equal(one.feed(i), first[b])
            np.testing.assert_allclose(got[b], one.step(int(nxt[b])), rtol=0,
                                       atol=0 if exact else 1e-6 * np.abs(got[b]).max())
    finally:
        kernels.reset()


def test_one_sequence_batch(stories):
    """G = 1 (generate --parallel 1 --bench): the one-sequence program, the one-sequence tokens."""
    ids = _ids(stories)[0]
    got = BatchGenerator(stories, n_seq=1, n_ctx=64).generate_batch([ids], 10)
    assert got[0].tokens == alone(stories, ids, 10, SamplerConfig(temp=0.0), n_ctx=64)


def test_each_sequence_stops_on_its_own(stories):
    """A full context stops the longest prompt first; the others go on (the finished one is padding)."""
    ids = _ids(stories)
    greedy = SamplerConfig(temp=0.0, seed=0)
    n_ctx = max(len(i) for i in ids) + 5
    got = BatchGenerator(stories, n_seq=4, n_ctx=n_ctx).generate_batch(ids, 12)
    for r, i in zip(got, ids):
        gen = Generator(stories, n_ctx=n_ctx)
        one = gen.generate(i, 12, Sampler(greedy))
        assert (r.tokens, r.stop) == (one.tokens, one.stop)
    assert sorted(r.stop for r in got) == ["context", "length", "length", "length"]


def test_seeded_sampling_is_reproducible(stories):
    """Sequence b samples from mt19937(seed + b): the batch repeats itself, and each sequence is
    the one-sequence generation of its prompt with that seed."""
    ids = _ids(stories)
    cfg = SamplerConfig(temp=0.9, seed=1234)
    runs = [[r.tokens for r in BatchGenerator(stories, n_seq=4, n_ctx=256)
             .generate_batch(ids, 24, batch_samplers(cfg, 4))] for _ in range(2)]
    assert runs[0] == runs[1]
    for b, i in enumerate(ids):
        assert runs[0][b] == alone(stories, i, 24, SamplerConfig(temp=0.9, seed=1234 + b))
    same = [ids[0]] * 4  # one prompt four times: four streams, four continuations
    copies = BatchGenerator(stories, n_seq=4, n_ctx=256).generate_batch(same, 24, batch_samplers(cfg, 4))
    assert len({tuple(r.tokens) for r in copies}) > 1
    assert [s.seed for s in batch_samplers(SamplerConfig(seed=2**32 - 1), 2)] == [2**32 - 1, 0]


def test_cuda_kernels_decode_the_batch_as_the_cpu(stories):
    """Positions per sequence in the CUDA kernels (cache write, softmax), under the emulator."""
    if not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    ids = _ids(stories)
    emu = BatchGenerator(stories, CUDABackend(np.float32, runtime=cuda_emu.EmuRuntime()), n_seq=4, n_ctx=64)
    cpu = BatchGenerator(stories, "cpu", n_seq=4, n_ctx=64)
    assert [r.tokens for r in emu.generate_batch(ids, 6)] == [r.tokens for r in cpu.generate_batch(ids, 6)]


@pytest.mark.cuda
def test_batch_on_a_real_gpu_is_each_prompt_alone(stories):
    """bench/gpu_check.sh's batched decode: on a CUDA device, G = 4 prompts decoded together give
    each prompt's one-sequence greedy tokens on that device, and the CPU's."""
    if not cuda.available():
        pytest.skip(f"no CUDA device: {cuda.unavailable_reason()}")
    ids = _ids(stories)
    greedy = SamplerConfig(temp=0.0, seed=0)
    got = [r.tokens for r in BatchGenerator(stories, "cuda", n_seq=4, n_ctx=128).generate_batch(ids, 24)]
    assert got == [alone(stories, i, 24, greedy, backend="cuda", n_ctx=128) for i in ids]
    assert got == [alone(stories, i, 24, greedy, n_ctx=128) for i in ids]


# ------------------------------------------------------------------------------ command line
def test_cli_parallel_prints_each_sequence(monkeypatch, capsys, stories_path):
    """--parallel 3: three continuations of the prompt, sequence 0 the one-sequence run's."""
    args = ("generate", stories_path, "-p", "Once upon a time", "-n", "12", "--seed", "7")
    code, one, _ = run_cli(monkeypatch, capsys, *args)
    assert code == 0
    code, out, err = run_cli(monkeypatch, capsys, *args, "--parallel", "3")
    assert code == 0, err
    texts = out.split("--- sequence ")[1:]
    assert [t.split("\n", 1)[0] for t in texts] == ["0", "1", "2"]
    assert texts[0].split("\n", 1)[1] == one
    assert "3 sequences, 36 tokens (-n reached 3)" in err and "seeds 7..9" in err and "3 x 11 steps" in err


def test_cli_bench_row(monkeypatch, capsys, stories_path):
    """--bench: no text, one row of llama-batched-bench's columns, every sequence -n tokens long."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", stories_path, "-p", "Once upon a time", "-n", "9",
                             "--parallel", "2", "--bench", "--temp", "0")
    assert code == 0, err
    cells = [c.strip() for c in out.strip().strip("|").split("|")]
    n_pp = len(Generator(load_model(stories_path), n_ctx=8).tokenize_prompt("Once upon a time"))
    assert cells[:4] == [str(n_pp), "8", "2", str(2 * (n_pp + 8))] and len(cells) == 10
    assert float(cells[7]) > 0 and "2 sequences, 18 tokens" in err


@pytest.mark.parametrize("args,message", [(("--parallel", "0"), "--parallel: must be positive"),
                                          (("--bench",), "--bench: needs -n N"),
                                          (("--chat", "--parallel", "2"), "--chat: one conversation")])
def test_cli_parallel_errors(monkeypatch, capsys, stories_path, args, message):
    code, _, err = run_cli(monkeypatch, capsys, "generate", stories_path, "-p", "Once", *args)
    assert code == 2 and message in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only")
@pytest.mark.parametrize("n_seq", [1, 3])
def test_unwritten_cache_pages_are_handed_back(stories, n_seq, monkeypatch):
    """After the passes that read unwritten positions (prompt buckets, the recording run), the
    generator hands their pages back (eval/generate.py _forget_unwritten): the written positions
    and the tokens are a run's that hands back nothing, and a marker planted past the written
    positions reads zero (it would not if those pages were kept)."""
    ids = _ids(stories)[:n_seq]

    def run(release: bool):
        if not release:
            monkeypatch.setattr(CPUBackend, "release_zeros", lambda self, buf: None)
        gen = BatchGenerator(stories, n_seq=n_seq, n_ctx=1024)
        for buf in gen.cache.values():
            buf[:, :, 512:] = 7.0  # past anything written: what a kept page would still hold
        got = gen.generate_batch(ids, 12)
        monkeypatch.undo()
        return [r.tokens for r in got], gen.cache

    kept_tokens, kept = run(release=False)
    tokens, cache = run(release=True)
    assert tokens == kept_tokens
    for name, buf in cache.items():
        for g, i in enumerate(ids):
            end = len(i) + 11  # prompt, and the last token's position (the 12th is sampled, not fed)
            np.testing.assert_array_equal(buf[g, :, :end], kept[name][g, :, :end])
        assert (kept[name][:, :, 512:] == 7).all()
        for g, h in np.ndindex(buf.shape[:2]):  # the whole pages of each sequence's head past 512
            tail = buf[g, h, 512:].reshape(-1)
            i0 = -(-tail.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE - tail.ctypes.data
            i1 = (tail.ctypes.data + tail.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE - tail.ctypes.data
            assert i1 > i0 and not tail[i0 // 4 : i1 // 4].any()
