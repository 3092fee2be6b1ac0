"""Workflows that write new model files: export/save (convert, quantize) and init (a new random model)."""
