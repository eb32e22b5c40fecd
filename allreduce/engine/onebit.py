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
``16 (p-1)`` bytes of scales per tensor: ``n / 4`` bytes against a ring
allreduce's ``2 (p-1)/p * 4 n`` for float32, about 32x fewer at large p.
Compute: a few passes over the bucket (sign, pack, unpack, scale).
"""
from __future__ import annotations

import numpy as np

from ..partition import chunk_offsets
from ..ops import Op
from .hooks import Bucket, CommHook, HookComm

__all__ = ["OneBit", "compress_signs", "decompress_signs"]

_SCALE_BYTES = 8            # each scale travels as a float64


def compress_signs(x: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """``(packed sign bits, scale, x - scale * sign(x))`` of a 1-D float array (sign of 0 is +)."""
    scale = float(np.abs(x).mean(dtype=np.float64)) if x.size else 0.0
    positive = x >= 0
    approx = np.where(positive, scale, -scale).astype(x.dtype)
    return np.packbits(positive), scale, x - approx


def decompress_signs(bits: np.ndarray, scale: float, n: int, dtype) -> np.ndarray:
    """``scale * sign`` for ``n`` values from packed sign bits."""
    positive = np.unpackbits(bits, count=n).astype(bool)
    return np.where(positive, scale, -scale).astype(dtype)


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
            x = x + e if e is not None and e.size == x.size else x.copy()
            for j in range(p):
                bits, scale, x[b[j]:b[j + 1]] = compress_signs(x[b[j]:b[j + 1]])
                to_owner[j].append(_message(bits, scale))
            worker[name] = x                                  # now the new worker error
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
                y += decompress_signs(bits, scale, n, np.float64)
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
