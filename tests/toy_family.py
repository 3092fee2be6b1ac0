"""A toy architecture defined outside llmtune: llama with biases on the q/k/v projections.

This one module is all it takes to add a family (the structure test shows it): hyper-parameters
as llama reads them, the tensor list with the three biases, and the graph — which is llama's,
because the build context's `mm` applies a `.bias` whenever the model has one."""

from llmtune.arch import register
from llmtune.arch.family import TensorSpec
from llmtune.arch.llama import Llama


@register
class LlamaQKVBias(Llama):
    name = "toy-qkv-bias"

    def tensors(self, hp):
        specs = []
        for spec in super().tensors(hp):
            specs.append(spec)
            if spec.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
                specs.append(TensorSpec(spec.name.replace(".weight", ".bias"), spec.shape[:1], "zeros"))
        return specs
