"""Matrix products on cuBLAS: how a row-major product of (possibly transposed, permuted, batched)
views maps onto cublas<t>gemmStridedBatched calls (plan_gemm), and ops.matmul's kernel."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llmtune.backends.cuda.launch import element_strides

_OP_N, _OP_T = 0, 1  # cublasOperation_t


def _matrix_layout(rows: int, cols: int, s_row: int, s_col: int):
    """How cuBLAS (column-major) can read a row-major-indexed matrix with these element strides.

    (False, ld): rows are contiguous, so the memory holds its transpose column-major;
    (True, ld): columns are contiguous (a transposed view), memory holds the matrix column-major;
    None: neither (needs a copy). ld obeys cuBLAS's ld >= max(1, stored rows)."""
    if (cols == 1 or s_col == 1) and (rows == 1 or s_row >= cols):
        return False, s_row if rows > 1 else max(cols, 1)
    if (rows == 1 or s_row == 1) and (cols == 1 or s_col >= rows):
        return True, s_col if cols > 1 else max(rows, 1)
    return None


@dataclass(frozen=True)
class GemmPlan:
    """One cublas<t>gemmStridedBatched call per entry of `offsets`.

    In cuBLAS's column-major terms it computes C^T = op(X) op(Y) with X = op_b(b), Y = op_a(a):
    C[m, n] row-major is C^T[n, m] column-major, so `m_cm` = n, `n_cm` = m."""

    trans_x: int
    trans_y: int
    m_cm: int
    n_cm: int
    k: int
    ldx: int
    ldy: int
    ldc: int
    stride_x: int
    stride_y: int
    stride_c: int
    batch: int
    offsets: tuple  # ((offset_x, offset_y, offset_c), ...) in elements, one per call


def _batch_strides(shape, strides, batch_shape):
    """Element strides of an operand's batch axes aligned to batch_shape (0 where broadcast)."""
    lead = len(batch_shape) - (len(shape) - 2)
    out = [0] * len(batch_shape)
    for i, (size, stride) in enumerate(zip(shape[:-2], strides[:-2])):
        out[lead + i] = stride if size != 1 else 0
    return out


def _collapse_batch(batch_shape, per_operand):
    """Merge batch axes that index memory as one axis in every operand -> [(size, (strides...))]."""
    dims = []
    for i, size in enumerate(batch_shape):
        if size == 1:
            continue
        st = tuple(s[i] for s in per_operand)
        if dims and all(p == q * size for p, q in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * size, st)
        else:
            dims.append((size, st))
    return dims


def plan_gemm(a_shape, a_strides, b_shape, b_strides, c_shape, c_strides, ta: bool, tb: bool):
    """The cuBLAS calls computing c = op(a) @ op(b) (numpy batch broadcasting), strides in elements.

    None when an operand's matrices are neither row- nor column-contiguous, or c is not
    row-contiguous: the caller copies that operand and plans again. Transposed views (the
    `ta`/`tb` flags and permuted inputs) are read in place through cuBLAS's transpose flags."""
    def mat(shape, strides, t):
        r, c, sr, sc = shape[-2], shape[-1], strides[-2], strides[-1]
        return (c, r, sc, sr) if t else (r, c, sr, sc)

    am, ak, asr, asc = mat(a_shape, a_strides, ta)
    bk, bn, bsr, bsc = mat(b_shape, b_strides, tb)
    la, lb = _matrix_layout(am, ak, asr, asc), _matrix_layout(bk, bn, bsr, bsc)
    lc = _matrix_layout(c_shape[-2], c_shape[-1], c_strides[-2], c_strides[-1])
    if la is None or lb is None or lc is None or lc[0]:
        return None
    batch_shape = tuple(c_shape[:-2])
    per_operand = [_batch_strides(b_shape, b_strides, batch_shape), _batch_strides(a_shape, a_strides, batch_shape),
                   _batch_strides(c_shape, c_strides, batch_shape)]
    dims = _collapse_batch(batch_shape, per_operand)
    batch, inner = (dims[-1][0], dims[-1][1]) if dims else (1, (0, 0, 0))
    outer = dims[:-1]
    offsets = []
    for idx in itertools.product(*[range(size) for size, _ in outer]):
        offsets.append(tuple(sum(i * st[j] for i, (_, st) in zip(idx, outer)) for j in range(3)))
    return GemmPlan(
        trans_x=_OP_T if lb[0] else _OP_N, trans_y=_OP_T if la[0] else _OP_N,
        m_cm=bn, n_cm=am, k=ak, ldx=lb[1], ldy=la[1], ldc=lc[1],
        stride_x=inner[0], stride_y=inner[1], stride_c=inner[2], batch=batch, offsets=tuple(offsets),
    )


class GemmKernels:
    """ops.matmul (and the products of the quant section) through the runtime's gemm."""

    def _k_matmul(self, out, a, b, ta, tb):
        k = a.shape[-2] if ta else a.shape[-1]
        if out.size == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        if not out.flags.c_contiguous:
            tmp = self.xp.empty(out.shape, out.dtype)
            self._k_matmul(tmp, a, b, ta, tb)
            self.xp.copyto(out, tmp)
            return out
        plan = self._plan(a, b, out, ta, tb)
        if plan is None:  # a view cuBLAS cannot read in place: copy the operand(s) that need it
            a, b = self._readable(a), self._readable(b)
            plan = self._plan(a, b, out, ta, tb)
        self.rt.gemm(out.dtype, plan, self.rt.ptr(b), self.rt.ptr(a), self.rt.ptr(out), self.precision)
        return out

    @staticmethod
    def _plan(a, b, out, ta, tb):
        return plan_gemm(a.shape, element_strides(a), b.shape, element_strides(b), out.shape,
                         element_strides(out), ta, tb)

    def _readable(self, x):
        s = element_strides(x)
        r, c, sr, sc = x.shape[-2], x.shape[-1], s[-2], s[-1]
        return x if _matrix_layout(r, c, sr, sc) is not None else self._contig(x)

    def _gemm_into(self, c, a, b, tb):
        """c = a @ op(b) for row-contiguous 2-D views (c may be a column slice of a wider matrix)."""
        plan = self._plan(a, b, c, False, tb)
        self.rt.gemm(c.dtype, plan, self.rt.ptr(b), self.rt.ptr(a), self.rt.ptr(c), self.precision)

    def _k_lora(self, out, y, x, a, b, s):
        """ops.lora on cuBLAS: t = s (x A^T), then y + t B^T (out may be y's buffer)."""
        x2 = x.reshape(-1, x.shape[-1])
        t = self.xp.empty((x2.shape[0], a.shape[0]), out.dtype)
        self._k_matmul(t, x2, a, False, True)
        self._k_scale(t, t, s)
        term = self.xp.empty(out.shape, out.dtype)
        self._k_matmul(term.reshape(-1, out.shape[-1]), t, b, False, True)
        return self.xp.add(y, term, out=out)

    def _k_lora_back(self, out, x, a, b, g, s, dx):
        """ops.lora_back on cuBLAS: u = s (g B), t = s (x A^T); [dx = u A | dA = u^T x | dB = g^T t]."""
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        n_dx, rank = (x.size if dx else 0), a.shape[0]
        u, t = (self.xp.empty((x2.shape[0], rank), out.dtype) for _ in range(2))
        self._k_matmul(u, g2, b, False, False)
        self._k_scale(u, u, s)
        self._k_matmul(t, x2, a, False, True)
        self._k_scale(t, t, s)
        if dx:
            self._k_matmul(out[:n_dx].reshape(x2.shape), u, a, False, False)
        self._k_matmul(out[n_dx : n_dx + a.size].reshape(a.shape), u, x2, True, False)
        self._k_matmul(out[n_dx + a.size :].reshape(b.shape), g2, t, True, False)
        return out
