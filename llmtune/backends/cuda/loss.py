"""The CUDA kernels of ops.py's loss section (loss.cu): logsumexp, cross entropy (mean over the
rows whose target is not masked) and its gradient, the per-row NLL of token_nll and its
gradient, count_correct; and the loss over vocabulary chunks (vocab_stats, linear_cross_entropy and
its backward, vocab_hits): backends/vocab_chunks.py over this backend's products and cupy."""

from __future__ import annotations

import numpy as np

from llmtune.backends import vocab_chunks
from llmtune.backends.cuda.launch import BLOCK, flat_grid, row_threads


class LossKernels:
    def _k_logsumexp(self, out, x):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("logsumexp_rows", out.dtype, (rows,), row_threads(n), x, out, np.int32(n))
        return out

    def _counted(self, targets, rows: int, dtype):
        """The divisor of the mean, on the device: the rows whose target is not negative (masked),
        or the row count when every row is masked (loss 0; no rows at all: NaN, as numpy)."""
        n = self.xp.count_nonzero(targets >= 0)
        return self.xp.asarray(self.xp.where(n > 0, n, rows), dtype=dtype)

    def _k_cross_entropy(self, out, logits, targets, lse):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        losses = self.xp.empty(rows, logits.dtype)
        if rows:
            self._launch("cross_entropy_rows", out.dtype, flat_grid(rows), (BLOCK,), logits,
                         targets, self._contig(lse), losses, np.int64(rows), np.int32(n_vocab))
        self.xp.sum(losses, out=out)
        self.xp.divide(out, self._counted(targets, rows, out.dtype), out=out)  # mean over the counted rows
        return out

    def _k_cross_entropy_back(self, out, logits, targets, lse, g):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        if out.size:
            per_row = self.xp.asarray(g, dtype=out.dtype) / self._counted(targets, rows, out.dtype)
            gs = self._contig(self.xp.asarray(per_row, dtype=out.dtype))
            self._launch("cross_entropy_back", out.dtype, flat_grid(out.size), (BLOCK,), logits,
                         targets, self._contig(lse), gs, out, np.int64(rows), np.int32(n_vocab))
        return out

    def _k_token_nll(self, out, logits, targets, lse):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        if rows:
            self._launch("cross_entropy_rows", out.dtype, flat_grid(rows), (BLOCK,), logits,
                         targets, self._contig(lse), out, np.int64(rows), np.int32(n_vocab))
        return out

    def _k_token_nll_back(self, out, logits, targets, lse, g):
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        if out.size:
            self._launch("token_nll_back", out.dtype, flat_grid(out.size), (BLOCK,), logits,
                         targets, self._contig(lse), self._contig(g), out, np.int64(rows), np.int32(n_vocab))
        return out

    def _per_row(self, name, logits, targets):
        """A [rows] buffer filled by a one-block-per-row kernel over the logits."""
        logits, rows, n_vocab = self._rows(logits)
        targets = self._ids(targets).reshape(-1)
        per_row = self.xp.empty(rows, logits.dtype)
        if rows:
            self._launch(name, logits.dtype, (rows,), row_threads(n_vocab), logits, targets, per_row, np.int32(n_vocab))
        return per_row

    def _k_count_correct(self, out, logits, targets):
        hits = self._per_row("count_correct_rows", logits, targets)
        self.xp.sum(hits, out=out)
        return out

    # ------------------------------------------------------------------ the loss over vocabulary chunks
    def _vocab_kit(self, qtype):
        """This backend's Kit for backends/vocab_chunks.py: W's row blocks multiplied in W's storage."""
        if qtype:
            product = lambda o, x, rows: self._k_qlinear(o, x, rows, qtype, False)  # noqa: E731
            product_back = lambda o, g, rows: self._k_qlinear_back(o, g, rows, qtype)  # noqa: E731
        else:
            product = lambda o, x, rows: self._k_matmul(o, x, rows, False, True)  # noqa: E731
            product_back = lambda o, g, rows: self._k_matmul(o, g, rows, False, False)  # noqa: E731
        return vocab_chunks.Kit(self.xp, product, product_back, self._k_matmul, self._k_logsumexp,
                                self._k_token_nll_back, self._k_softcap, self._k_softcap_back)

    def _k_vocab_stats(self, out, x, w, targets, chunk, cap, qtype):
        return vocab_chunks.logit_stats(self._vocab_kit(qtype), out, self._contig(x), w, self._ids(targets), chunk, cap)

    def _k_linear_cross_entropy(self, out, x, w, targets, stats, chunk, cap, qtype, mean):
        targets = self._ids(targets).reshape(-1)
        nll = self.xp.where(targets >= 0, stats[0] - stats[1], 0).astype(out.dtype)
        if mean:
            self.xp.sum(nll, out=out)
            self.xp.divide(out, self._counted(targets, targets.size, out.dtype), out=out)
        else:
            out.reshape(-1)[...] = nll
        return out

    def _k_linear_cross_entropy_back(self, out, x, w, targets, stats, g, chunk, cap, qtype, mean, dx, dw):
        x, targets = self._contig(x), self._ids(targets)
        gw = vocab_chunks.row_weights(self.xp, targets, g, mean, out.dtype)
        return vocab_chunks.grads(self._vocab_kit(qtype), out, x, w, targets, stats, gw, chunk, cap, dx, dw)

    def _k_vocab_hits(self, out, stats):
        self.xp.sum(stats[2], out=out)
        return out
