"""PowerSGD: send a rank-r approximation of the average gradient, found by one power-iteration step.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019; the semantics of
PyTorch DDP's ``powerSGD_hook``. Each tensor is viewed as a matrix ``M``:
its last dimension is the columns, everything before it the rows (a conv
kernel 3x3x64x128 is 576 x 128). Q (cols x r) starts the same on every rank,
drawn from ``seed`` and the tensor's name::

    rank i                                                   every rank
    M_i = G_i + e_i           add last step's error (error feedback)
    P_i = M_i Q               rows x r
              ── allreduce all P's of the bucket, ONE call ──>   P = avg_i M_i Q
                                                                 P = orthonormalise(P): Gram-Schmidt,
    Q_i = M_i^T P             cols x r (sent as Q_i^T)           column by column, in float64
              ── allreduce all Q's of the bucket, ONE call ──>   Q = avg_i M_i^T P
                                                                 out = P Q^T = P P^T avg M
    e_i = M_i - out           what this rank's share missed      (avg M projected on P's columns)
    next step starts from this Q (warm start): the power iteration goes on across steps.

``out`` is ``avg M`` projected onto r directions; with ``r >= min(rows, cols)``
it is ``avg M`` itself, up to rounding. Error feedback keeps what the
projection dropped and adds it to the next step's gradient, so nothing is
lost for good: the outputs' running mean converges to the true mean.

Which tensors: one is compressed only where
``(rows + cols) * r * min_compression_rate < rows * cols`` and it has been
reduced ``start_iter`` times already (PyTorch's docs advise ~10% of
training). The rest (vectors, small matrices, every tensor before
``start_iter``) are packed into ONE plain allreduce: plain allreduce's
result (bit for bit wherever the sum is exact: tests/test_engine_hooks.py).

Cost per rank and step, for one rows x cols tensor at rank r:
``(rows + cols) * r`` elements in two allreduces, against ``rows * cols``
for plain allreduce; ResNet-50 at r = 4: 62x fewer elements (issue 32).
Compute: two matrix products of ``rows * cols * r`` multiply-adds each (M Q
and P^T M), and as many again for the output; three allreduces (plain, P, Q)
per bucket, so three latencies instead of one.

Bitwise identical on every rank: P and Q come out of allreduces (the same
bits on every rank: the engine's guarantee), and orthonormalising P and
forming ``P Q^T`` are sequential numba loops (no BLAS, no threads, no
fast-math: the same operations in the same order on the same bits). The
products ``M_i Q`` and ``M_i^T P`` may use BLAS: each is one rank's own
input to an allreduce.

Op ``Average`` approximates the average; ``Sum`` the sum (the allreduces sum
and each rank's error is ``M_i - out / p``). Other ops are refused at submit.
"""
from __future__ import annotations

import zlib

import numpy as np
from numba import njit

from ..errors import InvalidArgumentError
from ..ops import Op
from .hooks import Bucket, CommHook, HookComm

__all__ = ["PowerSGD", "matrix_shape", "orthonormalise", "low_rank_product"]

#: The least norm a column is divided by: a zero column (a zero gradient) stays zero instead of
#: becoming NaN, and any other column is divided by its own norm exactly. (PyTorch adds its
#: ``orthogonalization_epsilon`` to every norm instead, which biases every column slightly.)
EPSILON = 1e-30


def matrix_shape(shape: tuple) -> tuple[int, int]:
    """``(rows, cols)`` of a tensor viewed as a matrix: the last dimension against the rest."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows, cols


@njit(nogil=True, cache=True)
def orthonormalise(p, eps):
    """Make the columns of ``p`` (rows x r, in place) orthonormal: Gram-Schmidt, column by column,
    each column's dot products and norm accumulated in float64; a norm below ``eps`` divides as
    ``eps`` (a zero column stays zero)."""
    rows, r = p.shape
    for j in range(r):
        for k in range(j):                                  # remove the earlier columns' parts
            dot = 0.0
            for i in range(rows):
                dot += np.float64(p[i, k]) * p[i, j]
            for i in range(rows):
                p[i, j] = p[i, j] - dot * p[i, k]
        norm = 0.0
        for i in range(rows):
            norm += np.float64(p[i, j]) * p[i, j]
        norm = max(np.sqrt(norm), eps)                      # eps: a zero column stays zero
        for i in range(rows):
            p[i, j] = p[i, j] / norm


@njit(nogil=True, cache=True)
def low_rank_product(p, qt, out, acc, error, share, feedback):
    """``out = p @ qt`` (rows x r times r x cols) summed in float64, k = 0..r-1 in order for every
    element; ``acc`` is a float64 scratch row of ``cols``. With ``feedback``, ``error -= out * share``
    on the way (error feedback: M becomes M - this rank's share of the output). The inner loops
    run along a row, so they vectorise without reordering any element's sum."""
    rows, r = p.shape
    cols = qt.shape[1]
    for i in range(rows):
        for j in range(cols):
            acc[j] = 0.0
        for k in range(r):
            pik = np.float64(p[i, k])
            for j in range(cols):
                acc[j] += pik * qt[k, j]
        for j in range(cols):
            out[i, j] = acc[j]
        if feedback:
            for j in range(cols):
                error[i, j] = error[i, j] - out[i, j] * share


class PowerSGD(CommHook):
    """The PowerSGD communication hook (PyTorch DDP's ``powerSGD_hook`` semantics).

    Args:
        rank: r, the approximation's rank (1 sends least; 4 is often enough for ImageNet).
        start_iter: reduce each tensor plainly for its first ``start_iter`` reductions
            (PyTorch's ``start_powerSGD_iter``; its default, 1000).
        min_compression_rate: compress a tensor only where it sends at least this many
            times fewer elements: ``(rows + cols) * r * rate < rows * cols``.
        error_feedback: add what the approximation missed to the next step's gradient.
        warm_start: start each step's power iteration from the last step's Q (else a fresh
            random Q every step).
        seed: the initial Q's seed (every rank draws the same Q from it and the tensor's name).

    State (per communicator; see hooks.py): each tensor's reduction count, error and Q.
    """

    def __init__(self, rank: int = 1, *, start_iter: int = 1000, min_compression_rate: float = 2,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0):
        if not isinstance(rank, (int, np.integer)) or rank < 1:
            raise InvalidArgumentError(f"PowerSGD rank must be an integer >= 1, got {rank!r}")
        if not isinstance(start_iter, (int, np.integer)) or start_iter < 0:
            raise InvalidArgumentError(f"PowerSGD start_iter must be an integer >= 0, got {start_iter!r}")
        if not min_compression_rate >= 0:
            raise InvalidArgumentError(f"PowerSGD min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank, self.start_iter = int(rank), int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback, self.warm_start, self.seed = bool(error_feedback), bool(warm_start), int(seed)
        self.name = (f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, min_compression_rate="
                     f"{self.min_compression_rate!r}, error_feedback={self.error_feedback}, "
                     f"warm_start={self.warm_start}, seed={self.seed})")

    def compresses(self, shape: tuple, reductions: int = 1 << 62) -> int:
        """The rank a tensor of ``shape`` is sent at after ``reductions`` earlier reductions
        (0: sent plainly)."""
        rows, cols = matrix_shape(shape)
        r = min(self.rank, rows, cols)
        if reductions < self.start_iter or r == 0:
            return 0
        return r if (rows + cols) * r * self.min_compression_rate < rows * cols else 0

    def _initial_q(self, name: str, cols: int, r: int, dtype, step: int) -> np.ndarray:
        """The same Q on every rank: drawn from (seed, the name's CRC-32[, the step])."""
        key = [self.seed, zlib.crc32(name.encode())] + ([] if self.warm_start else [step])
        return np.random.default_rng(key).standard_normal((cols, r)).astype(dtype)

    def reduce(self, bucket: Bucket, comm: HookComm, state: dict) -> list[np.ndarray]:
        steps = state.setdefault("steps", {})
        outs: list = [None] * len(bucket)
        plain, low = [], []                        # bucket positions; low: (i, rows, cols, r)
        for i, (name, shape) in enumerate(zip(bucket.names, bucket.shapes)):
            r = self.compresses(shape, steps.get(name, 0))
            if r:
                low.append((i, *matrix_shape(shape), r))
            else:
                plain.append(i)
        if plain:                                  # 1. the uncompressed tensors: ONE plain allreduce
            buf = np.concatenate([bucket.arrays[i] for i in plain]) if len(plain) > 1 \
                else bucket.arrays[plain[0]].copy()
            comm.allreduce(buf, bucket.op)
            at = 0
            for i in plain:
                n = bucket.arrays[i].size
                outs[i], at = buf[at:at + n], at + n
        if low:
            self._low_rank(bucket, comm, state, low, outs)
        for name in bucket.names:
            steps[name] = steps.get(name, 0) + 1
        return outs

    def _low_rank(self, bucket: Bucket, comm: HookComm, state: dict, low: list, outs: list) -> None:
        """Steps 2-6 of the module docstring for the bucket's compressed tensors. Q travels and is
        kept transposed (r x cols: ``Q^T = P^T M`` streams M by rows), and with error feedback M
        is built in the error's own buffer and becomes the new error there: no copy of M."""
        errors, qs, steps = state.setdefault("errors", {}), state.setdefault("q", {}), state["steps"]
        dtype, op = bucket.dtype, bucket.op
        ms, qts = [], []
        for i, rows, cols, r in low:               # 2. M = G + e (in e's buffer), and each tensor's Q
            name = bucket.names[i]
            m = bucket.arrays[i].reshape(rows, cols)
            if self.error_feedback:
                e = errors.get(name)
                if e is None or e.shape != m.shape or e.dtype != m.dtype:   # new, or the name's shape changed
                    e = errors[name] = m.copy()
                else:
                    e += m
                m = e
            ms.append(m)
            qt = qs.get(name) if self.warm_start else None
            qts.append(qt if qt is not None and qt.shape == (r, cols) and qt.dtype == dtype else
                       np.ascontiguousarray(self._initial_q(name, cols, r, dtype, steps.get(name, 0)).T))
        p_at = np.cumsum([0] + [rows * r for _, rows, _, r in low])
        q_at = np.cumsum([0] + [cols * r for _, _, cols, r in low])
        pbuf, qbuf = np.empty(p_at[-1], dtype), np.empty(q_at[-1], dtype)
        ps = [pbuf[p_at[k]:p_at[k + 1]].reshape(rows, r) for k, (_, rows, _, r) in enumerate(low)]
        qts_new = [qbuf[q_at[k]:q_at[k + 1]].reshape(r, cols) for k, (_, _, cols, r) in enumerate(low)]
        for m, qt, p in zip(ms, qts, ps):          # 3. P_i = M_i Q, all in one buffer
            np.matmul(m, qt.T, out=p)
        comm.allreduce(pbuf, op)                   # ... one allreduce for every P of the bucket
        for p in ps:                               # 4. orthonormalise (the same bits everywhere), in
            p64 = p.astype(np.float64)             # float64: float32 Gram-Schmidt loses orthogonality
            orthonormalise(p64, EPSILON)           # as eps x cond(P): 1e-4 at r = 16, by hand
            p[...] = p64
        for m, p, qt in zip(ms, ps, qts_new):      # 5. Q_i^T = P^T M_i, all in one buffer
            np.matmul(p.T, m, out=qt)
        comm.allreduce(qbuf, op)                   # ... one allreduce for every Q of the bucket
        share = dtype.type(1.0 / comm.size if op == Op.SUM else 1.0)   # this rank's share of the result
        for k, (i, rows, cols, r) in enumerate(low):       # 6. out = P Q^T; the error; keep Q
            out = np.empty((rows, cols), dtype)
            low_rank_product(ps[k], qts_new[k], out, np.empty(cols, np.float64),
                             ms[k] if self.error_feedback else out, share, self.error_feedback)
            outs[i] = out
            if self.warm_start:
                qs[bucket.names[i]] = qts_new[k].copy()
