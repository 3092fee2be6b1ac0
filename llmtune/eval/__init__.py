"""Evaluation: llama.cpp-compatible perplexity and KL-divergence."""
