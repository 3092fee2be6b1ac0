"""A GGUF model loaded for graphs: hyper-parameters, weights, tokenizer."""
