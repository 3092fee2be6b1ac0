#!/usr/bin/env bash
# One-shot check of the CUDA backend on a lent GPU machine, under 8 minutes in all (each step has
# its own timeout; their sum, 470 s, leaves room for start-up):
#   0. gguf from .whl/ when the machine lacks it (no network there);
#   1. the CUDA op tests (tests/test_backends.py's cuda parameter, then every other cuda-marked test,
#      among them batched decode: G prompts decoded together equal to each alone, greedy, on the
#      device (tests/test_batched.py), and two GRPO steps with --backend cuda sampling the CPU
#      run's completions and reaching its losses (tests/test_grpo.py));
#   2. the SmolLM2 shape on the GPU: QLoRA (LoRA r8 over the Q4_1 file) and LoRA (over its f32
#      export) finetunes at ctx 128, `generate`, batched decode's throughput (`generate --parallel
#      B --bench`, B = 1 and 16: llama-batched-bench's row), `perplexity` and `eval` (HellaSwag);
#   2b. a 7B-class QLoRA step: two of qwen2-7b's blocks, q4_k_m, LoRA r16, ctx 512, --grad-checkpoint;
#   3. the training benchmark (15M and 110M shapes, ctx 512, f32 and bf16 matmuls, per-op profile).
# Logs and the benchmark's JSON go to $OUT when set, else bench/out/. A missing piece (cupy, the
# model) is skipped with a message. (The random model: init + Q4_1 export took 207 s on the busy
# 2-core host, load ~14; the step allows 60 s on the 16-core GPU host.) Exit status: non-zero when a step failed or timed out.
#
#   bash bench/gpu_check.sh                  # from anywhere; runs in the repository root
#   bash bench/gpu_check.sh --prepare MODEL  # on the host, before: the files step 2 travels with
#
# Step 2's model: $SMOLLM2 (default .models/SmolLM2-135M-Instruct.Q4_1.gguf). The real file is
# ~94 MiB, more than a device run carries with the working tree (64 MiB), so `--prepare MODEL`
# writes its tokenizer alone to .models/smollm2-vocab.gguf (ignored by git; carry .models and
# .whl), from which this script builds a model of SmolLM2's shape (configs/smollm2-135m.toml)
# with random weights, exported to Q4_1 as the real file is: the same shapes and types, so the
# same speed; the losses mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODELS=.models
VOCAB="$MODELS/smollm2-vocab.gguf"

if [ "${1:-}" = "--prepare" ]; then
    [ -f "${2:-}" ] || { echo "gpu_check --prepare: give the SmolLM2 GGUF (got '${2:-}')" >&2; exit 2; }
    mkdir -p "$MODELS"
    "$PY" - "$2" "$VOCAB" <<'EOF'
import sys
from llmtune.convert.init import tokenizer_metadata
from llmtune.gguf.file import write_gguf
print(write_gguf(sys.argv[2], "llama", tokenizer_metadata(sys.argv[1]), []))
EOF
    exit 0
fi

LOG="${OUT:-bench/out}"
mkdir -p "$LOG"
status=0
section() { printf '\n===== %s (%s) =====\n' "$1" "$(date -u +%T)" | tee -a "$LOG/summary.txt"; }
note() { echo "$*" | tee -a "$LOG/summary.txt"; }
# step NAME SECONDS CMD...: the command under a timeout, its output in $LOG/NAME.txt; a failure
# (or pytest's "nothing selected", 5, which passes) is noted and the run goes on
step() {
    local name="$1" secs="$2" rc=0
    shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$LOG/$name.txt" 2>&1 || rc=$?
    tail -n 4 "$LOG/$name.txt"
    if [ "$rc" -eq 0 ] || { [ "$rc" -eq 5 ] && [ "$1" = "$PY" ] && [ "${2:-}" = "-m" ] && [ "${3:-}" = "pytest" ]; }; then
        note "$name: ok ($((SECONDS - t0)) s)"
    else
        [ "$rc" -eq 124 ] && note "$name: TIMED OUT after $secs s" || note "$name: FAILED (exit $rc, $((SECONDS - t0)) s)"
        status=1
    fi
}

section "0. environment"
if ! "$PY" -c "import gguf" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    else
        note "gguf is not installed and .whl/ holds no wheel: llmtune cannot load GGUF files"
    fi
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
    "$PY" - <<'EOF' || true
import numpy, sys
print("python", sys.version.split()[0], "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy unusable:", exc)
from llmtune.backends import cuda
print("llmtune cuda available:", cuda.available(), "|", cuda.unavailable_reason())
EOF
} 2>&1 | tee "$LOG/env.txt"
if ! "$PY" -c "from llmtune.backends import cuda; raise SystemExit(not cuda.available())" 2>/dev/null; then
    note "the CUDA backend is not available here (see env.txt): nothing to check"
    exit 1
fi

section "1. CUDA op tests"
step tests_backends_cuda 65 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_backends.py -k "cuda and not emu"
step tests_marked_cuda 45 "$PY" -m pytest -q -rs -p no:cacheprovider tests -m cuda --ignore=tests/test_backends.py \
    --continue-on-collection-errors

section "2. SmolLM2 shape: QLoRA, LoRA, generate, perplexity, eval"
MODEL="${SMOLLM2:-$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf}"
WORK="$(mktemp -d)"
if [ ! -f "$MODEL" ] && [ -f "$VOCAB" ]; then
    note "no $MODEL: a random-weight model of SmolLM2's shape from $VOCAB (Q4_1, as the real file)"
    step smollm2_make 60 bash -c "'$PY' -m llmtune init --config configs/smollm2-135m.toml --vocab-from '$VOCAB' \
        -o '$WORK/smollm2.f32.gguf' --seed 0 && '$PY' -m llmtune export '$WORK/smollm2.f32.gguf' --type q4_1 \
        -o '$WORK/smollm2.q4_1.gguf'"
    MODEL="$WORK/smollm2.q4_1.gguf"
    F32="$WORK/smollm2.f32.gguf"
else
    F32="$WORK/smollm2.f32.gguf"
fi
if [ ! -f "$MODEL" ]; then
    note "SKIPPED: no SmolLM2 model ($MODEL) and no $VOCAB (run 'bash bench/gpu_check.sh --prepare MODEL' first)"
else
    [ -f "$F32" ] || step smollm2_f32_export 20 "$PY" -m llmtune export "$MODEL" --type f32 -o "$F32"
    TEXT="$WORK/wiki.txt"
    "$PY" -c "import gzip,sys; sys.stdout.write(gzip.decompress(open('tests/data/wikitext-2-raw-test.txt.gz','rb').read()).decode()[:60000])" > "$TEXT"
    TRAIN=(--ctx 128 --batch 512 --epochs 1 --lr 1e-4 --lora-rank 8 --val-split 0.05 --backend cuda)
    step qlora_q4_1 30 "$PY" -m llmtune finetune "$MODEL" "$TEXT" -o "$WORK/qlora.gguf" "${TRAIN[@]}" \
        --metrics "$LOG/qlora_metrics.jsonl"
    [ -f "$F32" ] && step lora_f32 30 "$PY" -m llmtune finetune "$F32" "$TEXT" -o "$WORK/lora.gguf" "${TRAIN[@]}" \
        --metrics "$LOG/lora_metrics.jsonl"
    step generate 15 "$PY" -m llmtune generate "$MODEL" -p "Once upon a time" -n 64 --temp 0 --backend cuda
    step batched_decode 20 bash -c "for b in 1 16; do '$PY' -m llmtune generate '$MODEL' -p 'Once upon a time' \
        --parallel \$b -n 65 --bench --temp 0 --backend cuda; done"
    step perplexity 15 "$PY" -m llmtune perplexity "$MODEL" "$TEXT" --ctx 512 --chunks 8 --backend cuda
    step eval_hellaswag 15 "$PY" -m llmtune eval "$MODEL" tests/data/benchmarks/hellaswag-20.txt --hellaswag --backend cuda
fi
rm -rf "$WORK"

section "2b. 7B-class QLoRA: two of qwen2-7b's blocks, q4_k_m, r16, ctx 512, --grad-checkpoint"
# qwen2-7b's blocks (3584 wide, SwiGLU 18944, 28/4 heads) at 2 of 28, with SmolLM2's vocabulary tied
# (a 152k-token output would take minutes of single-threaded k-quant init): a step's block work is
# 2/28 of the 7B model's, so tok/s x 2/28 ~ a 7B step's (torchtune's Llama-3.1-8B QLoRA on one
# RTX 4090: 2,413 tok/s at 7.4 GiB)
if [ -f "$VOCAB" ]; then
    WORK="$(mktemp -d)"
    sed 's/^n_layer = .*/n_layer = 2/; s/^tied_output = .*/tied_output = true/' configs/qwen2-7b.toml > "$WORK/q7b2.toml"
    step q7b_blocks_make 65 "$PY" -m llmtune init --config "$WORK/q7b2.toml" --vocab-from "$VOCAB" \
        -o "$WORK/q7b2.gguf" --type q4_k_m
    "$PY" -c "import gzip,sys; sys.stdout.write(gzip.decompress(open('tests/data/wikitext-2-raw-test.txt.gz','rb').read()).decode()[:9000])" > "$WORK/wiki.txt"
    step q7b_blocks_qlora 40 "$PY" -m llmtune finetune "$WORK/q7b2.gguf" "$WORK/wiki.txt" -o "$WORK/a.gguf" \
        --lora-rank 16 --ctx 512 --grad-checkpoint --val-split 0 --epochs 1 --backend cuda \
        --metrics "$LOG/q7b_blocks_metrics.jsonl"
    rm -rf "$WORK"
else
    note "SKIPPED: no $VOCAB (run 'bash bench/gpu_check.sh --prepare MODEL' first)"
fi

section "3. training benchmark: 15M and 110M shapes"
step bench_cuda 50 "$PY" bench/bench_cuda.py --shapes 15m,110m --ctx 512 --seqs 8 --steps 3 --precision f32,bf16 \
    --profile --json "$LOG/bench_cuda.json"

section "done"
note "gpu_check: exit $status"
exit $status
