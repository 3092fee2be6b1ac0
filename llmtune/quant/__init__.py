"""Block (de)quantization (legacy and K-quants), llama.cpp's per-tensor export type policy, and
products with frozen matrices kept in their file type (qtensor.py, matmul.py)."""
