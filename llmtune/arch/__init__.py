"""Architecture registry: arch name -> module with `tensor_shapes(hp)` and `build(hp, w, batch, logits_start)`."""

from llmtune.arch import llama

ARCHS = {"llama": llama}


def get_arch(name: str):
    return ARCHS[name]
