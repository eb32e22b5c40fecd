"""1-bit compressed allreduce with two error feedbacks (DeepSpeed's, from 1-bit Adam and 0/1 Adam).

Each tensor is cut into p chunks; rank j owns chunk j. Every value travels as
its sign, one bit, and each chunk carries one scale: the mean of its absolute
values, the scale that makes ``x -> scale * sign(x)`` shrink the error
(``|x - s sign x|^2 = |x|^2 - |x|_1^2 / n``: EF-SignSGD, Karimireddy et al.
2019; DeepSpeed uses ``|x|_2 / sqrt(n)``)::

    rank i                                           owner j of chunk j
    x = G_i + e_i (worker error)
    chunk x into p parts; for chunk j:
      s_ij = mean |x_j|, bits = sign(x_j) >= 0
      e_i[chunk j] = x_j - s_ij sign(x_j)
    ── alltoall: chunk j's bits + s_ij to rank j ──>   y = 1/p sum_i s_ij sign_ij + f_j  (server error)
                                                       t_j = mean |y|, bits = sign(y) >= 0
                                                       f_j = y - t_j sign(y)
    every rank  <── allgather: every owner's bits + t_j ──
    out[chunk j] = t_j sign_j              (Sum: p times that)

Every rank decodes the same bits with the same scales, so the result is the
same bits on every rank. All tensors of a bucket travel together: one
alltoall and one allgather per bucket. The worker error is per tensor and
rank; the server error per tensor, for the chunk this rank owns.

Cost per rank and step, n elements, p ranks: the alltoall sends
``(p-1)/p * n / 8`` bytes and the allgather ``(p-1)/p * n / 8`` more, plus
``16 (p-1)`` bytes of scales per tensor: ``(p-1)/p * n / 4`` bytes against a
ring allreduce's ``(p-1)/p * 8 n`` for float32, 32x fewer at any p (less the
scales: ResNet-50's 214 tensors, 32.0x, benchmarks/hooks_bench.py).
Compute: a few numba passes over the bucket (mean |x|, signs packed eight a
byte, error, unpack). ResNet-50's Keras gradients (25.6 M float32) in one
bucket, p = 2, the collectives stubbed out: ~150 ms a step on the loaded
2-core VM, by hand (numpy's where/packbits/astype took ~1.6 s).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..partition import chunk_offsets
from ..ops import Op
from .hooks import Bucket, CommHook, HookComm

__all__ = ["OneBit", "compress_signs", "decompress_signs"]

_SCALE_BYTES = 8            # each scale travels as a float64


@njit(nogil=True, cache=True)
def _mean_abs(x):
    total = 0.0
    for i in range(x.size):
        total += abs(x[i])
    return total / x.size if x.size else 0.0


@njit(nogil=True, cache=True)
def _signs(x, scale, bits, error):
    """bits = packed (x >= 0), most significant bit first (np.packbits' order); error = x - scale sign(x)
    (``error`` may be ``x`` itself). Two branch-free loops, so both vectorise."""
    n = x.size
    for b in range(bits.size):                       # eight signs a byte
        byte = 0
        for k in range(8):
            i = b * 8 + k
            byte = (byte << 1) | (1 if i < n and x[i] >= 0 else 0)
        bits[b] = byte
    for i in range(n):                               # -scale is exact: x + scale, bit for bit
        error[i] = x[i] - scale * (2 * (x[i] >= 0) - 1)


@njit(nogil=True, cache=True)
def _add_signs(bits, scale, acc):
    """acc += scale * sign, the signs from packed bits (1: +)."""
    for i in range(acc.size):
        acc[i] += scale if (bits[i >> 3] >> (7 - (i & 7))) & 1 else -scale


@njit(nogil=True, cache=True)
def _expand(bits, scale, out):
    """out = scale * sign, the signs from packed bits (1: +)."""
    for i in range(out.size):
        out[i] = scale if (bits[i >> 3] >> (7 - (i & 7))) & 1 else -scale


def compress_signs(x: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """``(packed sign bits, scale, x - scale * sign(x))`` of a 1-D float array (sign of 0 is +);
    the scale is the mean of ``|x|`` (float64), applied in ``x``'s dtype."""
    scale = _mean_abs(x)
    bits, error = np.empty((x.size + 7) // 8, np.uint8), np.empty_like(x)
    _signs(x, x.dtype.type(scale), bits, error)
    return bits, scale, error


def decompress_signs(bits: np.ndarray, scale: float, n: int, dtype) -> np.ndarray:
    """``scale * sign`` for ``n`` values from packed sign bits, in ``dtype``."""
    out = np.empty(n, dtype)
    _expand(bits, out.dtype.type(scale), out)
    return out


def _message(bits: np.ndarray, scale: float) -> np.ndarray:
    return np.concatenate([bits, np.array([scale], np.float64).view(np.uint8)])


def _read(buf: np.ndarray, at: int, n: int) -> tuple[np.ndarray, float, int]:
    """The packed bits of ``n`` values and their scale at byte ``at``; the next offset."""
    nbytes = (n + 7) // 8
    bits = buf[at:at + nbytes]
    scale = float(buf[at + nbytes:at + nbytes + _SCALE_BYTES].view(np.float64)[0])
    return bits, scale, at + nbytes + _SCALE_BYTES


class OneBit(CommHook):
    """DeepSpeed's 1-bit compressed allreduce as a communication hook.

    Every float32/float64 tensor is sent as one sign bit per value plus one scale per chunk,
    with a worker error and a server error carried to the next step (state per communicator:
    see hooks.py). Results are the same bits on every rank.
    """

    name = "OneBit()"

    def reduce(self, bucket: Bucket, comm: HookComm, state: dict) -> list[np.ndarray]:
        p, me, dtype = comm.size, comm.rank, bucket.dtype
        worker, server = state.setdefault("worker", {}), state.setdefault("server", {})
        bounds = [chunk_offsets(x.size, p) + [x.size] for x in bucket.arrays]
        # 1. Worker side: add the error, compress each chunk, one message per owner.
        to_owner: list[list[np.ndarray]] = [[] for _ in range(p)]
        for name, x, b in zip(bucket.names, bucket.arrays, bounds):
            e = worker.get(name)
            if e is None or e.size != x.size or e.dtype != x.dtype:   # new, or the name changed shape
                e = worker[name] = x.copy()
            else:
                e += x                                        # x + error, in the error's own buffer
            x = e
            for j in range(p):
                chunk = x[b[j]:b[j + 1]]
                scale = _mean_abs(chunk)
                bits = np.empty((chunk.size + 7) // 8, np.uint8)
                _signs(chunk, dtype.type(scale), bits, chunk)     # the chunk becomes its error, in place
                to_owner[j].append(_message(bits, scale))      # (x is now the new worker error)
        send_parts = [np.concatenate(parts) if parts else np.empty(0, np.uint8) for parts in to_owner]
        mine = sum((b[me + 1] - b[me] + 7) // 8 + _SCALE_BYTES for b in bounds)   # bytes from each rank
        recv = np.empty(mine * p, np.uint8)
        comm.alltoallv(np.concatenate(send_parts), [s.size for s in send_parts], recv, [mine] * p)
        # 2. Owner side: average my chunk of each tensor, add the server error, compress again.
        back, at = [], [i * mine for i in range(p)]
        for name, b in zip(bucket.names, bounds):
            n = b[me + 1] - b[me]
            y = np.zeros(n, np.float64)
            for i in range(p):                                # rank order: the same sum on every owner
                bits, scale, at[i] = _read(recv, at[i], n)
                _add_signs(bits, scale, y)
            y = (y / p).astype(dtype)
            f = server.get(name)
            if f is not None and f.size == n:
                y += f
            bits, scale, server[name] = compress_signs(y)
            back.append(_message(bits, scale))
        # 3. Allgather every owner's chunks; decode the same bits on every rank.
        block = np.concatenate(back) if back else np.empty(0, np.uint8)
        counts = [sum((b[j + 1] - b[j] + 7) // 8 + _SCALE_BYTES for b in bounds) for j in range(p)]
        gathered = np.empty(sum(counts), np.uint8)
        comm.allgatherv(block, gathered, counts)
        outs = [np.empty(x.size, dtype) for x in bucket.arrays]
        at = 0
        for j in range(p):
            for out, b in zip(outs, bounds):
                n = b[j + 1] - b[j]
                bits, scale, at = _read(gathered, at, n)
                out[b[j]:b[j + 1]] = decompress_signs(bits, scale, n, dtype)
        if bucket.op == Op.SUM:                               # the average's p times, in the dtype
            for out in outs:
                out *= dtype.type(p)
        return outs
