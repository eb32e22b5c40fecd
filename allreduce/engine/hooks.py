"""Communication hooks: what the engine does with one fused bucket of tensors.

The anchor is PyTorch DDP's ``register_comm_hook``: a hook receives one
bucket (the tensors one engine batch fused: their names, shapes and flat
arrays, one dtype and one op) and a communicator, runs whatever collectives
it likes, and returns the reduced tensors::

    engine cycle (cycle.py)                 the batch's hook
    -----------------------                 ----------------
    ready names ─ plan ─> batches ──────>   hook.run_batch(batch, comm)
      one dtype, op and hook                  compressors (none, fp16, bf16):
      per batch (fusion.py)                     pack (cast) -> ONE allreduce -> unpack
                                              other hooks (PowerSGD, OneBit, yours):
                                                Bucket(names, shapes, arrays, op)
                                                -> reduce(bucket, comm, state) -> arrays
    handles <─ results ──────────────────   one result per tensor, in bucket order

There is one path: every batch runs through its hook's ``run_batch``. The
built-in compressors are the simplest hooks (compress, one allreduce,
decompress: :mod:`.fusion` packs them straight into its buffer);
``compression=`` names them, ``comm_hook=`` names any hook.

Agreement. A hook's ``name`` spells its settings (``PowerSGD(rank=2, ...)``)
and travels in every tensor's negotiation metadata (negotiation.py), so a
rank whose hook or settings differ fails that tensor with ``MismatchError``
on every rank, naming each rank's value, before any hook runs. Every rank
forms the same batches from agreed metadata, so every rank calls the same
hook with the same names in the same order, and its collectives meet.

State. ``reduce`` gets a dict that lives across steps (per-tensor errors,
warm-start factors, step counts; key it by tensor name). It is kept per
communicator: a hook that meets a new communicator (a new engine after
``ar.init()`` again, or after an elastic recovery, where the size may have
changed) starts there from empty state, and the old state goes with the old
communicator. Error feedback from ranks that are gone would be wrong, and a
restarted rank has none: resetting on every rank is the one choice that
keeps every rank's state in step (tests/test_elastic_hooks.py kills a rank
of an ``--elastic`` run: after the recovery the survivors' hook reduces as a
new one would). ``hook.reset()`` empties it by hand
(call it on every rank). A hook object may serve several engines at once
(thread ranks in tests): each communicator has its own state.

A reset must happen on every rank alike, and so the ranks check it: beside
the hook's ``name``, each tensor's negotiation metadata says whether this
hook's state for that tensor is new or carried from earlier steps
(:meth:`CommHook.agreement`). A ``reset()`` on some ranks only, or a new hook
object on some ranks, then fails that tensor with ``MismatchError`` on every
rank, naming each rank's side, instead of entering collectives whose sizes or
counts differ (PowerSGD's plain warm-up against its low-rank steps) and
waiting there until the transport's timeout. The marker changes once per
tensor, after its first reduction: one more announcement, then cached again.

Errors. A hook that raises, or returns the wrong number or sizes of results,
fails its bucket's handles on that rank and the engine goes on. It must fail
alike on every rank (decide only from agreed data: names, shapes, op, its
settings and its state), or its peers wait in a collective it never entered
until the transport timeout, which stops the engine everywhere.

Cost: what the hook sends. A compressor: one allreduce of the bucket's wire
bytes, 2 n (p-1)/p x wire bytes per rank on a ring. PowerSGD and OneBit:
their module docstrings.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from ..algorithms.allgather import allgatherv
from ..algorithms.alltoall import alltoallv
from ..errors import InvalidArgumentError
from ..ops import Op

__all__ = ["CommHook", "Bucket", "HookComm"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_STATES_LOCK = threading.Lock()


class Bucket:
    """One batch of tensors, as a hook sees it.

    Attributes:
        names: the tensors' names (the same on every rank, in the same order).
        shapes: their shapes.
        arrays: their values, flat (1-D, contiguous); read them, never write them.
        op: ``Op.SUM`` or ``Op.AVERAGE`` (what the result must approximate).
        dtype: the one dtype of every array.
    """

    __slots__ = ("names", "shapes", "arrays", "op", "dtype")

    def __init__(self, names: list[str], shapes: list[tuple], arrays: list[np.ndarray], op: Op,
                 dtype: np.dtype):
        self.names, self.shapes, self.arrays, self.op, self.dtype = names, shapes, arrays, op, dtype

    def __len__(self) -> int:
        return len(self.names)


class HookComm:
    """What a hook may do over the engine's communicator (engine thread only).

    Attributes:
        rank, size: this rank and the number of ranks.
        key: the engine's :class:`~allreduce.comm.Communicator`: what a hook's state is kept per.
        fusion: the engine's :class:`~allreduce.engine.fusion.Fusion` (the compressors' packing).
    """

    def __init__(self, transport, communicator, reducer, fusion, timeline=None):
        self.rank, self.size = transport.rank, transport.size
        self.transport, self.key, self.fusion = transport, communicator, fusion
        self._reducer = reducer
        self.timeline = timeline

    def allreduce(self, buf: np.ndarray, op: Op) -> str:
        """Reduce the contiguous 1-D ``buf`` in place with the engine's algorithm (the result is the
        same bits on every rank); return the algorithm's name."""
        return self._reducer.allreduce(buf, op)

    def allgatherv(self, block: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        """Rank r's ``block`` of ``counts[r]`` elements into ``out``, in rank order, on every rank."""
        allgatherv(self.transport, block, out, counts)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        """Send ``send_counts[j]`` elements of ``send`` (in rank order) to rank j; receive
        ``recv_counts[i]`` from rank i into ``recv`` (in rank order)."""
        alltoallv(self.transport, send, send_counts, recv, recv_counts)


class CommHook:
    """Base class of communication hooks: subclass it and write :meth:`reduce`.

    A subclass sets :attr:`name` to a string that spells every setting that changes
    results (ranks compare it), and keeps its settings read-only after construction.
    """

    name = "hook"
    #: Whether ranks compare this hook's state age per tensor at negotiation (:meth:`agreement`);
    #: the stateless compressors do not.
    keeps_state = True
    #: A large plain tensor of this hook's batch may be reduced in its own result array
    #: (fusion.py's direct batches): only for the plain compressor, never for a hook that
    #: needs the bucket's tensors together.
    direct_ok = False

    # -- what a hook writes ------------------------------------------------------------------
    def reduce(self, bucket: Bucket, comm: HookComm, state: dict) -> list[np.ndarray]:
        """Reduce ``bucket`` across ranks; return one array per tensor (its size; any shape).

        Args:
            bucket: the tensors of one fused batch.
            comm: collectives over the engine's communicator.
            state: this hook's dict on this communicator, kept across steps.

        Returns:
            The results, in bucket order, bitwise identical on every rank.
        """
        raise NotImplementedError

    def check(self, dtype: np.dtype, op: Op, rank: int) -> None:
        """Refuse, at submit, a tensor this hook cannot reduce (float32/float64, Sum or Average)."""
        if np.dtype(dtype) not in _FLOATS:
            raise InvalidArgumentError(f"rank {rank}: comm hook {self.name} reduces float32 and float64 "
                                       f"tensors, not {np.dtype(dtype)}; submit it without comm_hook")
        if op not in (Op.SUM, Op.AVERAGE):
            raise InvalidArgumentError(f"rank {rank}: comm hook {self.name} approximates a Sum or an "
                                       f"Average, not {op!r}; use ar.Average or ar.Sum, or no comm_hook")

    # -- state ----------------------------------------------------------------------------------
    def state(self, key) -> dict:
        """This hook's state on communicator ``key`` (a new, empty dict the first time it is met)."""
        with _STATES_LOCK:
            states = self.__dict__.get("_states")
            if states is None:
                states = self.__dict__["_states"] = weakref.WeakKeyDictionary()
            state = states.get(key)
            if state is None:
                state = states[key] = {}
            return state

    def reset(self) -> None:
        """Forget every step's state (errors, warm starts, step counts), on every communicator.
        Call it on every rank alike: the ranks' states must stay in step (a rank that did not
        fails the next step's tensors with ``MismatchError`` on every rank)."""
        with _STATES_LOCK:
            self.__dict__.pop("_states", None)
            self.__dict__.pop("_reduced", None)

    def agreement(self, tensor: str, key) -> str:
        """What the ranks compare for ``tensor`` through this hook (the metadata's compression
        field): :attr:`name`, and whether this hook has reduced ``tensor`` on communicator ``key``
        since its state began (a new object, ``reset()``, a new communicator).

        Read at submit; a name cannot be submitted again before its last reduction finished, so
        every rank in step reads the same answer."""
        with _STATES_LOCK:
            reduced = self.__dict__.get("_reduced")
            carried = reduced is not None and tensor in reduced.get(key, ())
        return f"{self.name}, {'state from earlier steps' if carried else 'new state'}"

    def _mark_reduced(self, key, names: list[str]) -> None:
        with _STATES_LOCK:
            reduced = self.__dict__.get("_reduced")
            if reduced is None:
                reduced = self.__dict__["_reduced"] = weakref.WeakKeyDictionary()
            reduced.setdefault(key, set()).update(names)

    # -- what the engine calls --------------------------------------------------------------
    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The engine sizes a batch by its tensors' own bytes (what a hook sends is its business)."""
        return np.dtype(dtype)

    def run_batch(self, batch, comm: HookComm) -> list[Any]:
        """Run :meth:`reduce` on one engine batch; return each entry's result (shaped, in place
        where it was submitted in place)."""
        entries = batch.entries
        start = time.monotonic()
        bucket = Bucket([e.name for e in entries], [e.array.shape for e in entries],
                        [e.flat for e in entries], batch.op, entries[0].flat.dtype)
        outs = self.reduce(bucket, comm, self.state(comm.key))
        self._mark_reduced(comm.key, bucket.names)           # before any handle completes (agreement)
        if len(outs) != len(entries):
            raise TypeError(f"comm hook {self.name} returned {len(outs)} results for a bucket of "
                            f"{len(entries)} tensors; return one per tensor, in bucket order")
        results = []
        for e, out in zip(entries, outs):
            out = np.asarray(out)
            if out.size != e.flat.size:
                raise TypeError(f"comm hook {self.name} returned {out.size} elements for {e.name!r}, "
                                f"which has {e.flat.size}")
            out = out.astype(e.flat.dtype, copy=False).reshape(-1)
            results.append(e.output(out) if e.inplace else out.reshape(e.array.shape))
        if comm.timeline is not None:
            comm.timeline.spans(bucket.names, "COMM_HOOK", start, time.monotonic(),
                                {"hook": self.name, "batch_tensors": len(entries)})
        return results

    def __repr__(self) -> str:
        return f"<comm hook {self.name}>"


def resolve(compression, comm_hook, rank: int):
    """The hook a submit names: ``comm_hook`` if given (then ``compression`` must be none), else
    ``compression`` (a compressor is a hook)."""
    if comm_hook is None:
        return compression
    if compression is not None and getattr(compression, "name", None) != "none":
        raise InvalidArgumentError(f"rank {rank}: pass compression= or comm_hook=, not both "
                                   f"(got {compression!r} and {comm_hook!r})")
    if not isinstance(comm_hook, CommHook):
        raise InvalidArgumentError(f"rank {rank}: comm_hook must be an ar.CommHook (ar.PowerSGD(), "
                                   f"ar.OneBit(), ar.Compression.fp16, ...), got {type(comm_hook).__name__}")
    return comm_hook
