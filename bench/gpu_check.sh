#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine, well under 8 minutes on an H200:
#   1. gguf from .whl/ when the machine lacks it (no network there), 2. the CUDA op tests
#   (tests/test_backends.py's cuda parameter, then every other cuda-marked test), 3. the training
#   benchmark (15M and 110M shapes, ctx 512, f32 and bf16 matmuls, per-op profile).
# Logs and the benchmark's JSON go to $OUT when set, else bench/out/. Exit status: non-zero when a
# test step failed or the benchmark did not finish.
#
#   bash bench/gpu_check.sh            # from anywhere; runs in the repository root
set -u -o pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-bench/out}"
mkdir -p "$LOG"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PY" - <<'EOF'
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

status=0
pytest_run() {  # name, then pytest arguments
    local name="$1"
    shift
    timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$LOG/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing selected
}
# the CUDA backend's own tests (the CPU-emulated variant is CI's business)
pytest_run tests_backends_cuda tests/test_backends.py -k "cuda and not emu"
# any other test marked cuda
pytest_run tests_marked_cuda tests -m cuda --ignore=tests/test_backends.py --continue-on-collection-errors

timeout 300 "$PY" bench/bench_cuda.py --shapes 15m,110m --ctx 512 --seqs 8 --steps 5 --precision f32,bf16 \
    --profile --json "$LOG/bench_cuda.json" 2>&1 | tee "$LOG/bench_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: exit $status" | tee -a "$LOG/env.txt"
exit $status
