"""The build context (llama.cpp's llm_graph_context): hyper-parameters, the batch and the weights
of one graph, with the shared layer builders as methods. A family's `build` is a short
composition of these; activations are 2-D [n_seq * n_tok, n_embd] between layers.

Weights are looked up by their GGUF base name ("blk.3.attn_q"); a tensor the file does not have
(an optional bias or norm) is simply skipped, as llama.cpp's builders skip null tensors, and
Model.build fails naming any required weight the graph never reached (a misspelled name).

The builders name their results as llama.cpp's cb(cur, "attn_norm", il) does ("attn_norm-3",
"Qcur-3", "ffn_out-3", "l_out-3", "result_output"): the names a dump of one forward pass lists
(graph/dump.py, LLMTUNE_DUMP), to compare with llama.cpp's eval-callback output.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtune.arch.hparams import HParams
from llmtune.graph import ops
from llmtune.graph.node import Node


@dataclass(frozen=True)
class Batch:
    """Symbolic inputs of one forward pass: n_seq sequences of n_tok tokens."""

    tokens: Node  # [n_seq, n_tok] int32
    # [n_tok] int32 positions (shared by all sequences); packed windows and a cache of several
    # sequences (batched decode): [n_seq, n_tok], positions per sequence
    pos: Node
    # [n_out] int32: the flat rows (seq * n_tok + tok) that produce logits, given at run time
    # (llama.cpp's inp_out_ids: a training pass scores only the targets that carry loss); None: all
    out_ids: Node | None = None

    @property
    def n_seq(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_tok(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def make(cls, n_seq: int, n_tok: int, packed: bool = False, n_out: int | None = None) -> "Batch":
        pos = (n_seq, n_tok) if packed else (n_tok,)
        out_ids = ops.input((n_out,), "i32", name="out_ids") if n_out is not None and n_out < n_seq * n_tok else None
        return cls(ops.input((n_seq, n_tok), "i32", name="tokens"), ops.input(pos, "i32", name="pos"), out_ids)


class BuildContext:
    """One forward graph under construction.

    logits_start: only positions logits_start.. of each sequence produce logits (perplexity
    scores the second half of a chunk); the last layer drops the other rows early.
    lora: the adapters' terms (model/adapter/terms.py LoraGraph: `apply(x, y, name)` in mm,
    `apply_rows(tokens, x, name)` in the embedding lookup), or None.
    cache: a KV cache (arch/kvcache.py KVCache) the attention writes the new k/v into and reads
    back, the batch's positions given at run time (generation), or None.
    prefix: the layout of a batch of shared prefixes and their continuations (arch/prefix.py
    SharedPrefix: evaluation of several answers to one question), or None.
    packing: the masks of packed windows (arch/packing.py Packing: several examples per training
    window, each attending to itself, positions per token), or None.
    round_x: products with a weight kept in its file type round the activations as llama.cpp's CPU
    matmul does (evaluation: llama.cpp's numbers); False multiplies them as they are (training, as
    QLoRA multiplies its dequantized base: no rounding to pay, no straight-through gradient).
    """

    def __init__(self, hp: HParams, weights: dict[str, Node], batch: Batch, logits_start: int = 0, lora=None,
                 cache=None, prefix=None, packing=None, round_x: bool = True, plain_attention_max: int | None = None):
        self.hp, self.weights, self.batch, self.logits_start = hp, weights, batch, logits_start
        self.lora, self.round_x = lora, round_x
        self.cache, self.prefix, self.packing = cache, prefix, packing
        self.plain_attention_max = plain_attention_max  # causal_attention's; None: its default

    @property
    def n_ctx(self) -> int:
        """The longest sequence the graph holds: the cache's size, a trunk and a branch of a
        shared-prefix layout, or the batch's tokens per sequence."""
        if self.cache is not None:
            return self.cache.n_ctx
        return self.prefix.shape.seq_len if self.prefix is not None else self.batch.n_tok

    # ------------------------------------------------------------------ names
    @staticmethod
    def cb(node: Node, name: str, il: int = -1) -> Node:
        """Name a computed node as llama.cpp's graph callback does: "name-il" in layer il, else
        "name" (leaves keep theirs: inputs are bound by name)."""
        if not node.is_leaf:
            node.name = f"{name}-{il}" if il >= 0 else name
        return node

    def cb_weight(self, node: Node, weight: str) -> Node:
        """Name a node after the weight it applies: "blk.3.attn_q" -> "attn_q-3"."""
        parts = weight.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            return self.cb(node, parts[2], int(parts[1]))
        return self.cb(node, weight)

    # ------------------------------------------------------------------ weights
    def tensor(self, name: str) -> Node:
        """A required tensor by full name ("position_embd.weight")."""
        return self.weights[name]

    def opt(self, name: str) -> Node | None:
        """An optional tensor by full name (None when the file does not have it). The builders
        that apply a weight (mm, norm) take its base name ("blk.0.attn_q") instead."""
        return self.weights.get(name)

    def mm(self, x: Node, name: str) -> Node:
        """x @ W^T (+ bias when the model has one): the one place a weight matrix is applied
        (llama.cpp's build_lora_mm: the base product, then each adapter's scale * (x A^T) B^T).
        ops.linear multiplies a frozen weight kept in its file type as it is stored."""
        y = ops.linear(x, self.weights[f"{name}.weight"], self.round_x)
        if self.lora is not None:
            y = self.lora.apply(x, y, f"{name}.weight")
        bias = self.opt(f"{name}.bias")
        return self.cb_weight(y if bias is None else ops.add(y, bias), name)

    # ------------------------------------------------------------------ layers
    def layers(self, x: Node, post_norms: bool = False) -> Node:
        """The pre-norm decoder stack of llama.cpp's llm_build_llama (and of its phi3, gpt2,
        gemma2/3 builders): per layer x += attn(norm(x)), x += ffn(norm(x)); post_norms (gemma):
        each branch is normed again before its residual add. The last layer keeps only the rows
        that produce logits (logit_rows) once attention has read them all."""
        n_layer = self.hp.n_layer
        for il in range(n_layer):
            blk = f"blk.{il}"
            h = self.attn(self.norm(x, f"{blk}.attn_norm"), il)
            if il == n_layer - 1:  # rows that produce no logits need no more work
                x, h = self.logit_rows(x), self.logit_rows(h)
            if post_norms:
                h = self.norm(h, f"{blk}.post_attention_norm")
            x = self.cb(ops.add(x, h), "ffn_inp", il)
            h = self.cb(self.ffn(self.norm(x, f"{blk}.ffn_norm"), blk), "ffn_out", il)
            if post_norms:
                h = self.norm(h, f"{blk}.post_ffw_norm")
            x = self.cb(ops.add(x, h), "l_out", il)
        return x

    def inp_embd(self) -> Node:
        """Token embeddings [n_seq * n_tok, n_embd] (llm_graph_context::build_inp_embd)."""
        b = self.batch
        x = ops.get_rows(self.weights["token_embd.weight"], b.tokens)
        if self.lora is not None:  # token_embd adapters: + scale * A[tokens] B^T
            x = self.lora.apply_rows(b.tokens, x, "token_embd.weight")
        return self.cb(ops.reshape(x, (b.n_seq * b.n_tok, self.hp.n_embd)), "inp_embd")

    def norm(self, x: Node, name: str, kind: str | None = None) -> Node:
        """RMS or layer norm with the optional weight and bias `name`.weight/.bias (build_norm)."""
        kind = kind or self.hp.norm_kind
        y = ops.rms_norm(x, self.hp.norm_eps) if kind == "rms" else ops.layer_norm(x, self.hp.norm_eps)
        weight, bias = self.opt(f"{name}.weight"), self.opt(f"{name}.bias")
        if weight is not None:
            y = ops.mul(y, weight)
        return self.cb_weight(y if bias is None else ops.add(y, bias), name)

    def ffn(self, x: Node, blk: str) -> Node:
        """Feed-forward block (build_ffn): gated down(act(gate x) * up x), or down(act(up x)).
        A fused gate+up matrix (phi3's ffn_up of 2 n_ff rows) is split in halves."""
        hp = self.hp
        if hp.ffn_gated and self.opt(f"{blk}.ffn_gate.weight") is None:
            up = self.mm(x, f"{blk}.ffn_up")
            h = self.gated_act(ops.slice_axis(up, 1, 0, hp.n_ff), ops.slice_axis(up, 1, hp.n_ff, 2 * hp.n_ff))
        elif hp.ffn_gated:
            h = self.gated_act(self.mm(x, f"{blk}.ffn_gate"), self.mm(x, f"{blk}.ffn_up"))
        else:
            up = self.mm(x, f"{blk}.ffn_up")
            h = ops.silu(up) if hp.activation == "silu" else ops.gelu(up)
        return self.mm(h, f"{blk}.ffn_down")

    def gated_act(self, gate: Node, up: Node) -> Node:
        """act(gate) * up, fused (swiglu or geglu)."""
        if not gate.contiguous:
            gate, up = ops.cont(gate), ops.cont(up)
        return ops.swiglu(gate, up) if self.hp.activation == "silu" else ops.geglu(gate, up)

    def attn(self, x: Node, il: int) -> Node:
        """Self-attention of layer il (build_attn): q/k/v projections (biases when present),
        optional per-head q/k norms, rope, causal grouped-query attention (softcapped, sliding
        window on the layers that have one), output projection."""
        q, k, v = self.qkv(x, il)
        return self.attn_out(q, k, v, il)

    def qkv(self, x: Node, il: int) -> tuple[Node, Node, Node]:
        """Per-head q, k, v [n_seq, n_tok, heads, head_dim] of layer il (build_qkv): separate
        attn_q/k/v projections, or one fused attn_qkv whose rows are [q | k | v] (gpt2, phi3)
        with its bias, or (legacy files) the three separate biases added to the split parts."""
        hp, blk = self.hp, f"blk.{il}"
        if self.opt(f"{blk}.attn_qkv.weight") is None:
            q = self.heads(self.mm(x, f"{blk}.attn_q"), hp.n_head)
            k = self.heads(self.mm(x, f"{blk}.attn_k"), hp.n_head_kv)
            v = self.heads(self.mm(x, f"{blk}.attn_v"), hp.n_head_kv)
            return q, k, v
        qkv = self.mm(x, f"{blk}.attn_qkv")
        nq, nkv = hp.n_embd_q, hp.n_embd_kv
        parts = {"q": (0, nq), "k": (nq, nq + nkv), "v": (nq + nkv, nq + 2 * nkv)}
        biases = {p: self.opt(f"{blk}.attn_{p}.bias") for p in parts}
        if self.opt(f"{blk}.attn_qkv.bias") is not None or None in biases.values():
            biases = dict.fromkeys(parts)  # llama.cpp adds separate biases only when all three exist
        out = []
        for p, (start, stop) in parts.items():
            y = ops.slice_axis(qkv, 1, start, stop)
            y = y if biases[p] is None else ops.add(y, biases[p])
            out.append(self.heads(y, hp.n_head if p == "q" else hp.n_head_kv))
        return tuple(out)

    def attn_out(self, q: Node, k: Node, v: Node, il: int) -> Node:
        """The rest of attention from per-head q, k, v [B, T, heads, head_dim] (families with a
        fused qkv projection enter here): q/k norms, rope, attention, output projection."""
        hp, b, blk = self.hp, self.batch, f"blk.{il}"
        q = self.cb(self.rope(self.head_norm(q, f"{blk}.attn_q_norm"), il), "Qcur", il)
        k = self.cb(self.rope(self.head_norm(k, f"{blk}.attn_k_norm"), il), "Kcur", il)
        v = self.cb(v, "Vcur", il)
        window = hp.sliding_window if hp.is_swa(il) else 0
        if self.cache is not None:
            out = self.cache.attention(q, k, v, il, b.pos, hp.kq_scale, softcap=hp.attn_softcap, window=window)
        elif self.prefix is not None:
            out = self.prefix.attention(q, k, v, hp.kq_scale, softcap=hp.attn_softcap, window=window)
        elif self.packing is not None:
            out = self.packing.attention(q, k, v, hp.kq_scale, softcap=hp.attn_softcap, window=window)
        else:
            out = causal_attention(q, k, v, hp.kq_scale, softcap=hp.attn_softcap, window=window,
                                   plain_max=self.plain_attention_max)
        out = self.cb(ops.reshape(out, (b.n_seq * b.n_tok, hp.n_embd_q)), "kqv_out", il)
        return self.mm(out, f"{blk}.attn_output")

    def heads(self, x: Node, n_head: int) -> Node:
        """[n_seq * n_tok, n_head * head_dim] -> [n_seq, n_tok, n_head, head_dim]."""
        return ops.reshape(x, (self.batch.n_seq, self.batch.n_tok, n_head, self.hp.head_dim))

    def head_norm(self, x: Node, name: str) -> Node:
        """Per-head RMS norm over head_dim (qwen3/gemma3 q/k norms); identity when absent."""
        if self.opt(f"{name}.weight") is None:
            return x
        return self.norm(x, name, "rms")

    def rope(self, x: Node, il: int) -> Node:
        """Rotary embedding of layer il: its base, and rope_freqs.weight frequency factors
        (Llama 3.1+) when the model has them (ggml_rope_ext)."""
        hp = self.hp
        if hp.rope_mode is None:
            return x
        factors = self.rope_factors(il)
        extra = {} if factors is None else {"freq_factors": factors}
        pos = self.batch.pos
        if len(pos.shape) == 2:  # positions per sequence (packed windows): rope the batch as one sequence
            rows = ops.reshape(x, (1, x.shape[0] * x.shape[1]) + x.shape[2:])
            y = ops.rope(rows, ops.reshape(pos, (pos.size,)), hp.n_rot, hp.rope_base(il), hp.rope_freq_scale,
                         hp.rope_mode, **extra)
            y = ops.reshape(y, x.shape)
        else:
            y = ops.rope(x, pos, hp.n_rot, hp.rope_base(il), hp.rope_freq_scale, hp.rope_mode, **extra)
        f = hp.rope_attn_factor
        if f == 1.0:
            return y
        # ggml_rope_ext's attn_factor scales cos and sin, so the rotated dims only
        d = x.shape[-1]
        if hp.n_rot == d:
            return ops.scale(y, f)
        rest = ops.scale(ops.slice_axis(x, len(x.shape) - 1, hp.n_rot, d), 1.0 - f)
        return ops.add(ops.scale(y, f), ops.pad_axis(rest, len(x.shape) - 1, hp.n_rot, d))

    def rope_factors(self, il: int) -> Node | None:
        """Frequency factors (llama_model::get_rope_factors): rope_freqs.weight when present,
        else phi3's rope_factors_long when the context exceeds the original training context,
        rope_factors_short otherwise (None when the model has neither). The context is n_tok
        rounded up to a multiple of 256, as llama.cpp pads n_ctx_seq (for real models, whose
        original context is a multiple of 256, the same as comparing n_tok)."""
        factors = self.opt("rope_freqs.weight")
        if factors is not None:
            return factors
        n_ctx_orig = self.hp.n_ctx_orig or self.hp.n_ctx_train
        n_ctx_seq = -(-self.n_ctx // 256) * 256
        return self.opt("rope_factors_long.weight" if n_ctx_seq > n_ctx_orig else "rope_factors_short.weight")

    def logit_rows(self, x: Node) -> Node:
        """Keep the rows that produce logits (rows of x are [seq, tok]): the batch's out_ids when
        given (ggml_get_rows(cur, inp_out_ids)), else positions logits_start.. of every sequence."""
        b, start = self.batch, self.logits_start
        if b.out_ids is not None:
            return ops.get_rows(x, b.out_ids)
        if start == 0:
            return x
        x3 = ops.reshape(x, (b.n_seq, b.n_tok, x.shape[-1]))
        kept = ops.slice_axis(x3, 1, start, b.n_tok)
        return ops.reshape(kept, (b.n_seq * (b.n_tok - start), x.shape[-1]))

    def output(self, x: Node) -> Node:
        """Final norm and the vocabulary projection (tied to token_embd when output is absent)."""
        x = self.cb(self.norm(x, "output_norm"), "result_norm")
        if self.opt("output.weight") is None:
            logits = ops.linear(x, self.weights["token_embd.weight"], self.round_x)
        else:
            logits = self.mm(x, "output")
        cap = self.hp.final_softcap
        return self.cb(ops.softcap(logits, cap) if cap else logits, "result_output")


def causal_attention(q: Node, k: Node, v: Node, kq_scale: float, softcap: float = 0.0, window: int = 0,
                     plain_max: int | None = None) -> Node:
    """Causal scaled-dot-product attention, q [B, T, H, d], k/v [B, T, Hkv, d] -> [B, T, H, d].

    softcap > 0: scores -> softcap * tanh(kq_scale * scores / softcap) before the softmax (gemma2);
    window > 0: a query sees only the keys less than `window` positions back (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD); query head h reads KV head h // (H / Hkv).

    Past PLAIN_ATTENTION_MAX_T (256) positions it is blockwise (ops.flash_attn: llama.cpp's
    ggml_flash_attn_ext), so memory grows with T, not T^2, in the forward and in training. Up to
    it, the plain composition: its [T, T] scores are small there and its few large products run
    faster (T=256: stories260K steps 17 %, the 15M shape's 8 % faster than blockwise). The
    KV-cached path (arch/kvcache.py) keeps the plain composition, whose query positions are given
    at run time. plain_max: another bound (a backend's plain_attention_max: 0 where the compiled
    blockwise kernels run every length faster).
    """
    if q.shape[1] > (PLAIN_ATTENTION_MAX_T if plain_max is None else plain_max):
        return ops.flash_attn(q, k, v, kq_scale, softcap, window)
    T = q.shape[1]
    mask = {"window": window} if window else {}
    return _plain_attention(q, k, v, kq_scale, softcap,
                            lambda scores, scale: ops.softmax_causal(scores, scale, n_kv=T, n_q=T, **mask))


def masked_attention(q: Node, k: Node, v: Node, kq_scale: float, mask: Node, softcap: float = 0.0) -> Node:
    """Attention of q [B, Tq, H, d] over k/v [B, Tk, Hkv, d] -> [B, Tq, H, d], the run-time mask
    [B, Tq, Tk] (0 or -inf: llama.cpp's KQ mask) deciding what each query sees. The plain
    composition: it serves evaluation (arch/prefix.py), whose scores are not kept."""
    return _plain_attention(q, k, v, kq_scale, softcap, lambda scores, scale: ops.softmax_masked(scores, scale, mask))


def _plain_attention(q: Node, k: Node, v: Node, kq_scale: float, softcap: float, softmax) -> Node:
    """softmax(scores) V with the [Tq, Tk] scores of every head; softmax(scores, scale) masks."""
    B, T, H, d = q.shape
    Hkv = k.shape[2]
    group = H // Hkv
    # the n_head/n_head_kv query heads that share a KV head are stacked along rows, so one matmul
    # per KV head serves the whole group and K/V are never copied
    qg = ops.reshape(ops.permute(q, (0, 2, 1, 3)), (B, Hkv, group * T, d))
    # [B, Hkv, Tk, d], made contiguous: BLAS then runs the batched matmuls (strided stacks fall
    # back to numpy's slow loop), and the copy is small next to the scores
    kt = ops.cont(ops.permute(k, (0, 2, 1, 3)))
    vt = ops.cont(ops.permute(v, (0, 2, 1, 3)))
    scores = ops.matmul(qg, kt, tb=True)  # [B, Hkv, group*T, Tk]
    if softcap:
        scores, kq_scale = ops.softcap(ops.scale(scores, kq_scale), softcap), 1.0
    probs = softmax(scores, kq_scale)
    out = ops.matmul(probs, vt)  # [B, Hkv, group*T, d]
    return ops.permute(ops.reshape(out, (B, H, T, d)), (0, 2, 1, 3))


# the longest context attended with the plain [T, T] composition (a [256, 256] float32 score
# matrix is 256 KiB per head); longer ones are blockwise. At 512 the plain scores and probabilities
# kept for the backward already cost a 1B model's LoRA run (32 heads, 16 layers) 0.5 GiB more.
PLAIN_ATTENTION_MAX_T = 256
