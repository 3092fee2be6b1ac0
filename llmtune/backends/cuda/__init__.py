"""The CUDA backend as a package (see backend.py for its layout)."""

from llmtune.backends.cuda.backend import PRECISIONS, CUDABackend
from llmtune.backends.cuda.gemm import GemmPlan, plan_gemm
from llmtune.backends.cuda.launch import element_strides
from llmtune.backends.cuda.runtime import available, kernel_source, unavailable_reason

__all__ = ["CUDABackend", "GemmPlan", "PRECISIONS", "available", "element_strides", "kernel_source", "plan_gemm",
           "unavailable_reason"]
