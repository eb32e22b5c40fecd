"""Tensor fusion: many small allreduces become one large one.

Ready tensors with the same dtype, op and comm hook (compression) are packed back to
back into one reusable fusion buffer, reduced with one allreduce, and
unpacked into each tensor's result::

    ready:   a(f32, 4 KB)  b(f32, 1 MB)  c(i64, 8 B)  d(f32, 2 KB)
    batches: [a b d] -> one f32 allreduce of ~1 MB      [c] -> one i64 allreduce
             (a batch closes when the next tensor would pass the threshold)

Why: every allreduce pays the latency terms (2(p-1) alpha for ring) once;
a hundred small gradients fused pay them once instead of a hundred times.

Compression is fused with packing: the fp16/bf16 cast writes straight into
the buffer (one pass, no temporary), pre-scaled by 1/p for Average so the
fp16 sum cannot overflow where the average would not; the buffer is then
reduced with Sum. The ranks agree (one tiny allreduce of per-tensor rank
bits) on which tensors overflowed anywhere: those fail with
``CompressionError`` on every rank; the rest of the batch goes ahead. The
same exchange says whether any rank's input held inf/NaN, so a non-finite
*result* from finite inputs (a Sum that overflowed fp16 on the wire) also
fails with CompressionError, decided from data that is identical on every
rank. When: for a Sum (and Average), only if some result holds an inf/NaN,
after the reduction, since any rank's inf/NaN shows in the sum (the result
is the same bits everywhere, so every rank takes the exchange or none).
That is one round trip fewer per batch: across a network link, a
millisecond of a 4 MiB fp16 allreduce's ~20. Min, Max, Product and custom
payloads agree before sending (a Min can hide an overflow), and an
overflowed tensor's part of the buffer is zeroed there.

Batching depends only on the ordered ready list and metadata that every
rank agreed on, so every rank forms the same batches in the same order.
"""
from __future__ import annotations

import time
from itertools import accumulate
from typing import Callable

import numpy as np

from .. import kernels
from ..buffers import ResultPool, Workspace
from ..errors import CompressionError
from ..ops import Op
from .compression import HalfCompressor
from .handle import Entry

__all__ = ["Batch", "plan", "Fusion"]

_BITS = 63


class Batch:
    """Tensors reduced together: one wire dtype, one op, one compressor. ``direct``: large plain
    tensors, each reduced in its own result array (no fusion buffer), all in one algorithm call."""

    __slots__ = ("entries", "wire", "op", "compressor", "nbytes", "direct")

    def __init__(self, wire: np.dtype, op: Op, compressor, direct: bool = False):
        self.entries: list[Entry] = []
        self.wire, self.op, self.compressor, self.nbytes, self.direct = wire, op, compressor, 0, direct


def _wire(entry: Entry) -> tuple[np.dtype, int]:
    wire = entry.wire                 # computed once: plan and run both ask, per tensor
    if wire is None:
        if entry.payload is not None:
            wire = entry.payload.dtype, entry.payload.size
        else:
            wire = entry.compressor.wire_dtype(entry.flat.dtype), entry.flat.size
        entry.wire = wire
    return wire


DIRECT_BYTES = 1 << 20
"""A plain (uncompressed) tensor this large is reduced straight in its result array: copying
it into and out of the fusion buffer would cost more memory traffic than its allreduce saves
in latency (on one node, ~1 ms moves 1 MiB; latency is ~20-50 us). Such tensors still share
one algorithm call (a direct batch, up to the threshold) where the algorithm can take several
arrays at once (``shm``): ResNet-50's 29 large gradients took 1.3x one call on the same bytes
as 29 calls, -np 2, by hand."""

MANY_DIRECT_BYTES = 64 << 10
"""The same limit when the engine's direct batches go through one many-array call (``shm`` on one
node, :attr:`Engine.many`): the call's windows run across array boundaries, so a tensor costs a
few microseconds of bookkeeping there instead of two copies. Measured by hand at -np 2 (median of
10): 100 x 64 KiB took 3.2 ms as one many-call against 4.0 ms packed into a buffer, reduced and
unpacked; 1000 x 4 KiB took 7.6 ms against 4.7 ms, so smaller tensors are still fused."""


def plan(ready: list[Entry], threshold: int, direct_bytes: int = DIRECT_BYTES) -> list[Batch]:
    """Group ``ready`` (in agreed order) into batches of at most ``threshold`` wire bytes.

    A tensor larger than the threshold gets a batch of its own; plain ones
    of at least ``direct_bytes`` go into direct batches (no fusion buffer);
    ``threshold=0`` turns fusion off (one batch per tensor), and so does Adasum (its
    coefficients belong to each tensor: one batch each). Only agreed
    metadata decides, so every rank forms the same batches.
    """
    batches: list[Batch] = []
    open_: dict[tuple, Batch] = {}
    key = batch = last = None
    adasum = Op.ADASUM                  # an enum member: a class attribute lookup each time
    for entry in ready:
        wire, count = entry.wire or _wire(entry)
        nbytes = count * wire.itemsize
        dtype, op, compressor = entry.flat.dtype, entry.op, entry.compressor
        direct = nbytes >= direct_bytes and entry.payload is None and wire == dtype and compressor.direct_ok
        # A run of tensors alike (a model's gradients: one dtype, op and compression) goes on in
        # the last batch: identity tests instead of a key built and hashed (~0.2 us a tensor).
        if last is None or not (dtype is last[0] and wire is last[1] and op is last[2]
                                and compressor is last[3] and direct is last[4]):
            key = (dtype, wire, op, compressor.name, direct)   # dtypes hash by value
            last = (dtype, wire, op, compressor, direct)
            batch = open_.get(key)
        if batch is None or (batch.entries and (batch.nbytes + nbytes > threshold or op is adasum)):
            batch = open_[key] = Batch(wire, op, compressor, direct)
            batches.append(batch)
        batch.entries.append(entry)
        batch.nbytes += nbytes
    return batches


class Fusion:
    """Packs, reduces and unpacks batches for one engine."""

    def __init__(self, rank: int, size: int, allreduce: Callable[[np.ndarray, Op, np.ndarray | None], str],
                 workspace: Workspace, timeline=None, transport=None,
                 control: Callable[[np.ndarray, Op], str] | None = None, *,
                 allreduce_many: Callable[[list, Op, list], str]):
        self.rank, self.size = rank, size
        self._allreduce = allreduce
        self._allreduce_many = allreduce_many     # a direct batch: several arrays, one call where it can
        self._control = control or allreduce      # small flag vectors: bounded waits
        self.workspace = workspace
        self.timeline, self.transport = timeline, transport
        self.residuals: dict[str, np.ndarray] = {}    # error feedback, per tensor name
        self.results = ResultPool()                   # new result arrays, recycled once dropped

    def run(self, batch: Batch) -> list[object]:
        """Reduce one batch (a compressor's hook: compression.py); return each entry's result
        array or exception, in order."""
        entries, comp = batch.entries, batch.compressor
        fused_half = isinstance(comp, HalfCompressor) and batch.wire != entries[0].flat.dtype
        custom = entries[0].payload is not None
        if batch.direct or (len(entries) == 1 and not fused_half and not custom):
            return self._run_direct(batch)           # plain tensors, each in its own result array
        op = Op.SUM if fused_half and batch.op == Op.AVERAGE else batch.op
        scale = 1.0 / self.size if fused_half and batch.op == Op.AVERAGE else 1.0
        offsets = [0, *accumulate([(e.wire or _wire(e))[1] for e in entries])]
        t_pack = time.monotonic()

        # Pack (a lone plain tensor went to _run_direct: it needs no fusion buffer).
        plain = not fused_half and not custom
        if plain:
            # One C call packs them all: a copy per tensor costs more in Python (and in handing
            # the GIL back and forth with submitting threads) than the bytes it moves. The packed
            # array is reduced in place and the results are views of it, so nothing is copied
            # out; only a batch of in-place tensors alone packs into the reused buffer (their
            # results go back into the callers' arrays).
            flats = [e.flat for e in entries]
            if all(e.inplace for e in entries):
                buf = self.workspace.get("engine.fusion", offsets[-1], batch.wire)
                np.concatenate(flats, out=buf)
            else:
                buf = np.concatenate(flats, out=self.results.empty(offsets[-1], batch.wire))
            bad = [(0, 0)] * len(entries)
        else:
            buf = self.workspace.get("engine.fusion", offsets[-1], batch.wire)
            bad = [self._pack(e, buf[offsets[i]:offsets[i + 1]], scale, fused_half)
                   for i, e in enumerate(entries)]
        t_reduce = time.monotonic()
        # A Sum of casts (Average is one, pre-scaled) shows every inf/NaN of any rank's payload in
        # its result, which is the same on every rank: there the ranks agree on the flags only
        # when a result holds an inf/NaN (rare), after the reduction. Other ops (a Min can hide
        # an overflow) and custom payloads agree before sending, as the module says.
        late = fused_half and op == Op.SUM
        failed, nonfinite_in = self._agree_overflow(entries, bad, buf, offsets) if (fused_half or custom) \
            and not late else ({}, set())

        # Reduce: one collective for the whole batch.
        if self.transport is not None:
            self.transport.record()
        algorithm = self._allreduce(buf, op)
        t_unpack = time.monotonic()
        phases = self.transport.stop(t_unpack) if self.transport is not None else []

        results: list[object] = []
        if plain:
            # A 1-D tensor's result is its slice of the buffer as it is (Entry.flat is the array
            # itself then, never for in place); others get their shape back. One view each, no copy.
            parts = [buf[a:b] for a, b in zip(offsets, offsets[1:])]
            results = [part if e.flat is e.array else e.output(part) if e.inplace
                       else part.reshape(e.array.shape) for e, part in zip(entries, parts)]
            if self.timeline is not None:
                self._trace(batch, False, algorithm, phases, t_pack, t_reduce, t_unpack)
            return results
        unpacked = [(e, None, 0) if e.name in failed else (e, *self._unpack(e, buf[offsets[i]:offsets[i + 1]],
                                                                            fused_half))
                    for i, e in enumerate(entries)]
        if late and any(nonfinite_out for _, _, nonfinite_out in unpacked):   # the same on every rank
            failed, nonfinite_in = self._agree_overflow(entries, bad, None, offsets)
        for e, result, nonfinite_out in unpacked:
            if e.name in failed:
                results.append(failed[e.name])
                continue
            if nonfinite_out and e.name not in nonfinite_in:   # finite inputs, inf/NaN sum
                result = self._wire_overflow(e, batch)         # (an in-place array keeps its input)
            elif e.inplace and result is not e.array:
                result = e.output(result.reshape(-1))
            results.append(result)
        if self.timeline is not None:
            self._trace(batch, fused_half or custom, algorithm, phases, t_pack, t_reduce, t_unpack)
        return results

    def _run_direct(self, batch: Batch) -> list[object]:
        """Plain tensors (a direct batch, or a lone one): each reduced in its result array (the
        caller's own for in place, else a new one the algorithm writes while reading the input),
        all in one call where the algorithm takes several."""
        t_pack = time.monotonic()
        bufs, srcs = [], []
        for e in batch.entries:
            bufs.append(e.flat if e.inplace else self.results.empty(e.flat.size, e.flat.dtype))
            srcs.append(None if e.inplace else e.flat)
        t_reduce = time.monotonic()
        if self.transport is not None:
            self.transport.record()
        algorithm = self._allreduce_many(bufs, batch.op, srcs)
        t_unpack = time.monotonic()
        phases = self.transport.stop(t_unpack) if self.transport is not None else []
        results = [e.output(b) if e.inplace else b.reshape(e.array.shape) for e, b in zip(batch.entries, bufs)]
        if self.timeline is not None:
            self._trace(batch, False, algorithm, phases, t_pack, t_reduce, t_unpack)
        return results

    # -- pieces ------------------------------------------------------------------------------
    def _pack(self, e: Entry, dst: np.ndarray, scale: float, fused_half: bool) -> tuple[int, int]:
        """Cast (fp16/bf16) or copy (a custom payload) ``e`` into the buffer; return (values that
        overflowed, non-finite inputs)."""
        if fused_half:
            residual = None
            if e.compressor.error_feedback:
                residual = self.residuals.get(e.name)
                if residual is None or residual.shape != e.flat.shape or residual.dtype != e.flat.dtype:
                    residual = self.residuals[e.name] = np.zeros_like(e.flat)
            return e.compressor.encode_into(dst.view(np.uint16), e.flat, scale, residual)
        # Otherwise a custom compressor's payload (plain batches are packed in run()).
        kernels.copy_into(dst, e.payload)
        if dst.dtype.kind == "f" and not np.isfinite(dst).all():
            return (0, 1) if not np.isfinite(e.flat).all() else (1, 0)
        return 0, 0

    def _unpack(self, e: Entry, part: np.ndarray, fused_half: bool) -> tuple[np.ndarray, int]:
        """``(result, inf/NaN count)``; the count is only checked for fused fp16/bf16."""
        if fused_half:
            if e.inplace and e.shares and not e.compressor.count_nonfinite(part.view(np.uint16)):
                # Straight into the caller's memory: no temporary, no copy back. Only after the
                # check, so a sum that overflowed on the wire leaves the caller's input as it was.
                e.compressor.decode_into(e.flat, part, 1.0)
                return e.array, 0
            out = self.results.empty(e.flat.size, e.flat.dtype)   # reused pages: fresh ones cost a fault each
            return out.reshape(e.array.shape), e.compressor.decode_into(out, part, 1.0)
        # Otherwise a custom compressor's payload (plain batches are unpacked in run()).
        return e.compressor.decompress(part.reshape(e.payload.shape).copy(), e.ctx), 0

    def _agree_overflow(self, entries: list[Entry], bad: list[tuple[int, int]], buf: np.ndarray | None,
                        offsets: list[int]) -> tuple[dict[str, CompressionError], set[str]]:
        """All ranks learn which tensors overflowed on any rank (failed, and zeroed in ``buf`` if
        given: before sending), and which had inf/NaN in some rank's input."""
        n, words = len(entries), -(-self.size // _BITS)
        flags = np.zeros(n * words + n, np.int64)     # overflow rank masks, then non-finite input counts
        word, bit = divmod(self.rank, _BITS)
        for i, (overflowed, nonfinite) in enumerate(bad):
            if overflowed:
                flags[i * words + word] = 1 << bit
            flags[n * words + i] = 1 if nonfinite else 0
        self._control(flags, Op.SUM)
        nonfinite_in = {e.name for i, e in enumerate(entries) if flags[n * words + i]}
        failed = {}
        for i, e in enumerate(entries):
            mask = flags[i * words:(i + 1) * words].tolist()
            ranks = [w * _BITS + b for w, v in enumerate(mask) for b in range(_BITS) if v >> b & 1]
            if ranks:
                if buf is not None:
                    buf[offsets[i]:offsets[i + 1]] = 0            # a zero contribution everywhere
                self.residuals.pop(e.name, None)
                failed[e.name] = CompressionError(
                    f"allreduce of {e.name!r}: {e.compressor.name} compression produced non-finite "
                    f"values on rank(s) {', '.join(map(str, ranks))} (overflow: |x| too large for "
                    f"{_wire(e)[0]}); " + ("nothing was sent for it" if buf is not None else
                                           "its result is dropped on every rank")
                    + ". Scale the tensor down or use a wider compression (bf16, or none).")
        return failed, nonfinite_in

    def _wire_overflow(self, e: Entry, batch: Batch) -> CompressionError:
        self.residuals.pop(e.name, None)
        return CompressionError(
            f"allreduce of {e.name!r}: the {batch.op!r} of the {e.compressor.name}-compressed inputs "
            f"overflowed {batch.wire} on the wire (every input was finite). Use ar.Average (pre-scaled "
            "by 1/p), scale the tensor down, or use bf16 or no compression.")

    def _trace(self, batch, compressed, algorithm, phases, t_pack, t_reduce, t_unpack) -> None:
        tl, names = self.timeline, [e.name for e in batch.entries]
        end = time.monotonic()
        info = {"batch_tensors": len(names), "batch_bytes": batch.nbytes, "algorithm": algorithm,
                "dtype": str(batch.wire), "op": repr(batch.op)}
        tl.spans(names, "COMPRESS" if compressed else "MEMCPY_IN_FUSION_BUFFER", t_pack, t_reduce)
        tl.spans(names, "ALLREDUCE", t_reduce, t_unpack, info)
        for phase, start, stop, steps in phases:
            tl.spans(names, phase, start, stop, {"steps": steps})
        tl.spans(names, "DECOMPRESS" if compressed else "MEMCPY_OUT_FUSION_BUFFER", t_unpack, end)
