"""Block (de)quantization (legacy and K-quants) and llama.cpp's per-tensor export type policy."""
