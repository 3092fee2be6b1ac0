"""A toy architecture defined outside llmtune: llama with biases on the q/k/v projections.

This one module is all it takes to add a family (the structure test shows it): hyper-parameters
as llama reads them, the tensor list with the three biases, and the graph — which is llama's,
because the build context's `mm` applies a `.bias` whenever the model has one."""

from llmtune.arch import register
from llmtune.arch.family import TensorSpec
from llmtune.arch.gpt2 import GPT2
from llmtune.arch.llama import Llama
from llmtune.graph import ops


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


class MisspelledNorm(LlamaQKVBias):
    """Not registered: the build-time check's test registers it. Its build misspells layer 0's
    ffn_norm ("ffn_nrom"), which a norm looks up as optional, as llama.cpp's builders skip null
    tensors; Model.build then names the required blk.0.ffn_norm.weight it never read."""

    name = "toy-misspelled-norm"

    def build(self, ctx):

        x = ctx.inp_embd()
        for il in range(ctx.hp.n_layer):
            x = ops.add(x, ctx.attn(ctx.norm(x, f"blk.{il}.attn_norm"), il))
            norm = "ffn_nrom" if il == 0 else "ffn_norm"
            x = ops.add(x, ctx.ffn(ctx.norm(x, f"blk.{il}.{norm}"), f"blk.{il}"))
        return ctx.output(x)


class GPT2WithoutNames(GPT2):
    """Not registered: gpt2 without its Hugging Face table, for the refusals of a family that has none
    (every built-in family has one); a test puts it in place of gpt2 (monkeypatch arch._FAMILIES)."""

    hf = None
