"""Optional compiled CPU kernels (C built at first use by the system compiler, cached per machine,
loaded with ctypes): build.py compiles, kernels.py calls. Without a compiler, after a failed build or
with LLMTUNE_NATIVE=0 every entry declines and numpy runs."""
