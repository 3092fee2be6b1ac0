"""Every backend's kernel table covers exactly the ops of graph/ops.OPS, checked without a GPU:
a missing or stale kernel fails here, not when some program first needs it."""

import pytest

from llmtune.backends.base import Kernel, kernel_table
from llmtune.backends.cpu import attention as cpu_attention, backend as cpu
from llmtune.backends.cuda import CUDABackend
from llmtune.graph import ops

KERNEL_OPS = set(ops.OPS) - {"input", "param", "const"}  # leaves are bound values, never computed


def test_cpu_table_covers_every_op():
    assert set(cpu.KERNELS) == KERNEL_OPS
    assert all(isinstance(k, Kernel) and callable(k) for k in cpu.KERNELS.values())
    # every way a kernel runs is in its record: nothing hangs on the functions themselves
    assert not [n for m in (cpu, cpu_attention) for n, f in vars(m).items()
                if n.startswith("k_") and (hasattr(f, "bind") or hasattr(f, "encode"))]
    assert cpu.KERNELS["matmul"].bind is not None and cpu.KERNELS["qlinear"].encode is not None
    assert cpu.CPUBackend().kernels == cpu.KERNELS
    # the table follows the convention (k_<op>), so a kernel function no op names is dead code
    unused = {name for module in (cpu, cpu_attention) for name in vars(module)
              if name.startswith("k_") and name[2:] not in cpu.KERNELS}
    assert not unused, unused


def test_cuda_table_covers_every_op():
    """Inspected on the class: building a CUDABackend needs cupy and a device."""
    assert set(CUDABackend.KERNELS) == KERNEL_OPS
    missing = [m for m in CUDABackend.KERNELS.values() if not callable(getattr(CUDABackend, m, None))]
    assert not missing, missing
    # a kernel method no op reaches is dead code
    unused = {m for m in dir(CUDABackend) if m.startswith("_k_")} - set(CUDABackend.KERNELS.values())
    assert not unused, unused


def test_a_bind_or_encode_for_an_op_without_a_kernel_is_refused():

    with pytest.raises(ValueError, match="without a kernel"):
        kernel_table(cpu, "k_", bind={"no_such_op": print})
