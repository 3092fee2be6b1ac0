"""The CPU backend, laid out like cuda/: backend.py (the backend and its numpy kernels), attention.py
(rope, the causal softmax, blockwise attention), products.py (products of matrices kept in their
GGUF type, and the float32 copies of frozen ones), threads.py (the cores: BLAS threads, workers,
ordered runs) and native/ (the optional compiled kernels: C built at first use, loaded with ctypes).

What the rest of llmtune may use of it is imported here; its modules are the backend's own
(tests/test_structure.py checks that nothing outside backends/ imports them).
"""

from llmtune.backends.cpu.backend import CPUBackend, logsumexp_rows
from llmtune.backends.cpu.native.kernels import to_f16  # import's F16 cast (False: numpy's astype instead)
from llmtune.backends.cpu.products import FloatCopies
from llmtune.backends.cpu.threads import blas_threads, cpu_workers, run_in_order, share_cores

__all__ = ["CPUBackend", "FloatCopies", "blas_threads", "cpu_workers", "logsumexp_rows", "run_in_order", "share_cores",
           "to_f16"]
