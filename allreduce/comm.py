"""A communicator: one transport plus everything a collective call needs.

This is the boundary where user input is validated. Everything below it
(algorithms, kernels, transports) trusts its arguments. A call:

    1. checks its arguments locally: dtype, op, algorithm, root_rank
       -> ``TypeError`` / ``ValueError`` before any message is sent;
    2. checks that every rank makes the same call (which collective, count,
       dtype, op, algorithm, root, a call number) -> ``MismatchError`` on *every*
       rank, naming the ranks and their values (``check=False`` skips
       this). The metadata travels as a two-integer head inside messages
       the algorithm sends anyway where it can (rd through the mailbox),
       else in head-only swaps (:mod:`allreduce.algorithms.agree`); the
       allgather that names the values runs only when they differ;
    3. runs the algorithm on a contiguous 1-D buffer.

``ar.init()`` builds one over MPI; tests and ``allreduce-explain`` build one
per thread over :class:`~allreduce.transport.threads.ThreadTransport`.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from . import algorithms
from .algorithms import agree
from .algorithms.allgather import allgather as _allgather_blocks
from .algorithms.broadcast import broadcast as _broadcast
from .auto import _ALGO_CODES, SMALL_BYTES, AutoChooser
from .autotune import AutoTuner
from .buffers import ResultPool, Workspace, as_flat, device_allreduce, is_device_array, restore
from .config import ALGORITHM_NAMES, Config
from .errors import InvalidArgumentError, MismatchError
from .ops import _CODES as _DTYPE_CODES   # dtype -> its code: one dict lookup on the hot path
from .ops import Op, as_op, check_dtype, dtype_code
from .transport import shared
from .transport.base import Transport

__all__ = ["Communicator"]

_ADASUM = Op.ADASUM      # a module global: an enum member looked up on its class costs ~0.1 us
_AVERAGE = Op.AVERAGE
_BOOL = _DTYPE_CODES[np.dtype(bool)]
_AUTO = _ALGO_CODES["auto"]

#: Every checked collective's first field: which collective it is. Ranks that disagree here are out
#: of step (one skipped a collective, after an error it caught or a branch on its rank): the head
#: swap that every checked call starts with (or rd's headed exchange) is the same message whatever
#: the collective, so they meet there and fail at once, not at the transport timeout.
COLLECTIVES = ("allreduce", "broadcast", "broadcast_object", "allgather", "allgather_object",
               "reducescatter", "alltoall", "barrier", "shared_empty", "remove_process_set")
_COLLECTIVE = {name: code for code, name in enumerate(COLLECTIVES)}   # allreduce is 0: its heads spell it
_FIELDS = ("collective", "count", "dtype", "op", "algorithm", "root_rank", "shared", "call")  # "call": set here
_SHOW = {"collective": lambda c: COLLECTIVES[c],
         "dtype": lambda c: str(np.dtype(_dtype_name(c))), "op": lambda c: repr(Op(c)),
         "algorithm": lambda c: ALGORITHM_NAMES[c],
         "shared": lambda c: "a private array" if c < 0 else f"shared_empty memory at byte {c}",
         "call": lambda c: f"checked call {c}"}


def _show(field: str, code: int) -> str:
    """One rank's value of ``field`` in words; -1 means the collective has no such field."""
    if code == -1 and field not in ("count", "call", "shared"):
        return "none"
    return _SHOW.get(field, str)(code)


def _dtype_name(code: int) -> str:
    from .ops import dtype_from_code
    return dtype_from_code(code).name


class Communicator(AutoChooser):
    """Collectives over one transport. Keyword arguments are keyword-only with defaults."""

    def __init__(self, transport: Transport, *, config: Config | None = None,
                 local_rank: int | None = None, local_size: int | None = None, cold: bool = False):
        self.transport = transport
        self.cold = cold          # auto chooses for data not in the cache (the engine's gradients)
        self.config = config or Config()
        self.workspace = Workspace()
        self.results = ResultPool()   # new result arrays: memory reused once the caller drops them
        self._local = (transport.rank if local_rank is None else local_rank,
                       transport.size if local_size is None else local_size)
        self._mpi_transport = getattr(transport, "comm", None) is not None
        self._candidates: tuple[str, ...] | None = None
        self._auto: dict[int, str] = {}          # nbytes -> auto's choice, for this communicator's life
        # auto measures its contenders on the first calls of a size (MPI only: the in-process
        # transport's tests and lessons keep the model's deterministic choice)
        self.tuner = AutoTuner() if self.config.autotune and self._mpi_transport and transport.size > 1 \
            else None
        # auto's pick must be the same on every rank (different algorithms would deadlock) even
        # where each node reads its own fitted cost model: on MPI, rank 0's pick is broadcast
        self._agree = self._mpi_transport and transport.size > 1
        self.auto_picks: dict[int, str] = {}     # auto_key -> what auto runs: the tuner's winner or rank 0's pick
        self._calls = 0                          # checked calls so far: part of each call's metadata
        # p = 2 on one node: the mailbox that carries the default call's one swap (_pair_call)
        self._box = getattr(transport, "mailbox", None) if transport.size == 2 else None
        self._rank = transport.rank

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    @property
    def local_rank(self) -> int:
        return self._local[0]

    @property
    def local_size(self) -> int:
        return self._local[1]

    # -- the metadata check ----------------------------------------------------------
    def check_agreement(self, what: str, **fields: int) -> None:
        """Raise ``MismatchError`` on every rank if ``fields`` differ between ranks.

        Agreement costs log2 p swaps of a two-integer head (a hash of the fields and
        this communicator's call number: :func:`~allreduce.algorithms.agree.agree`), not an
        allreduce: through the MPI transport's mailbox the integers ride in the counter's cache
        line, with no data. Every wait is bounded (native ``MPI_Allreduce``'s is not: a silent
        peer would hang the check). Only on a mismatch, and then on every rank alike, does it
        allgather the fields to name each rank's value.
        """
        if not self.config.check or self.size == 1:
            return
        values = self._metadata((_COLLECTIVE[what], *(fields.get(f, -1) for f in _FIELDS[1:-1])))
        self._raise_if_apart(what, values, agree.agree(self.transport, agree.head(values)))

    def _metadata(self, fields) -> tuple[int, ...]:
        """This call's metadata: ``fields`` and the call number (every rank counts the same calls)."""
        values = (*fields, self._calls)
        self._calls += 1
        return values

    def _raise_if_apart(self, what: str, values: tuple[int, ...], merged: tuple[int, int]) -> None:
        """``merged`` is every rank's head merged: if they differ, name every rank's fields and raise
        (on every rank: every rank holds the same ``merged``)."""
        if merged[0] == -merged[1]:
            return
        mine = np.array(values, dtype=np.int64)
        table = self.workspace.get("check", self.size * mine.size, np.int64)
        _allgather_blocks(self.transport, mine, table)
        table = table.reshape(self.size, mine.size)
        kinds = table[:, 0]
        if (kinds != kinds[0]).any():        # the other fields describe different calls: not compared
            calls = ", ".join(f"rank {r}: {COLLECTIVES[int(k)]}" for r, k in enumerate(kinds))
            raise MismatchError(f"the ranks are out of step: they call different collectives ({calls}). "
                                "A rank skipped or added a collective (an error it caught and went on "
                                "from, or a branch on its rank); every rank must call the same "
                                "collectives in the same order.")
        problems = []
        for j, field in enumerate(_FIELDS):
            column = table[:, j]
            if (column != column[0]).any():
                values = ", ".join(f"rank {r}: {_show(field, int(v))}" for r, v in enumerate(column))
                problems.append(f"{field} differs across ranks ({values})")
        raise MismatchError(f"{what}: " + "; ".join(problems)
                            + ". Every rank must call the same collective with the same arguments.")

    # -- allreduce ---------------------------------------------------------------------
    def _prepare(self, x, op, algorithm: str | None) -> tuple[np.ndarray, Op, str]:
        # The small-message path: every test below is a class or dict check first (tens of
        # nanoseconds), the general conversion only when it fails.
        if x.__class__ is not np.ndarray and not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if op.__class__ is not Op:
            op = as_op(op)
        if x.dtype not in _DTYPE_CODES:
            check_dtype(x.dtype, op)
        if op is _ADASUM:                     # p a power of two: the same answer on every rank, no message
            from .algorithms.adasum import check
            check(self.size, x.dtype, self.rank)
        if algorithm is None:
            algorithm = self.config.algorithm     # validated when the Config was made
        elif algorithm not in _ALGO_CODES:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHM_NAMES)}")
        return x, op, algorithm

    def _run_allreduce(self, flat: np.ndarray, op: Op, algorithm: str, transport: Transport | None = None,
                       src: np.ndarray | None = None) -> None:
        """Reduce into ``flat``: its own contents, or ``src``'s (an out-of-place call).

        With the check on, the call's metadata becomes a head (:mod:`allreduce.algorithms.agree`)
        that rides in rd's own exchanges where it can, and in head-only swaps before the
        algorithm everywhere else; a mismatch raises on every rank before any result is used."""
        values = None
        if self.config.check and self.transport.size > 1:
            registered = shared.find(self.transport, flat) if src is None else None
            values = (0, flat.size, _DTYPE_CODES[flat.dtype], int(op), _ALGO_CODES[algorithm], -1,
                      -1 if registered is None else registered[1], self._calls)
            self._calls += 1
        if op is _ADASUM:                 # its own algorithm, whatever ``algorithm`` says (Horovod's too)
            if values is not None:
                self._raise_if_apart("allreduce", values, agree.agree(self.transport, agree.head(values)))
            from .algorithms import adasum
            if src is not None:
                flat[...] = src
            adasum.allreduce(transport or self.transport, flat, op, workspace=self.workspace)
            return
        trial = watch = None
        if algorithm == "auto":
            # a kept pick under SMALL_BYTES is neither watched nor registered: one lookup (~3% of a 4 us call)
            algorithm = self.auto_picks.get(flat.nbytes) if flat.nbytes < SMALL_BYTES else None
            if algorithm is None:
                if values is not None and not self.auto_settled(flat, src, transport):
                    # choosing may talk (rank 0's pick, the tuner's plan): agree on the call first
                    self._raise_if_apart("allreduce", values, agree.agree(self.transport, agree.head(values)))
                    values = None
                algorithm, trial, watch = self.auto_resolve(flat, src, transport)
        start = time.perf_counter() if trial is not None or watch is not None else 0.0
        if values is not None:         # the check, timed with the algorithm that carries it (auto's tuner)
            mine = agree.head(values)
            if algorithm == "rd" and transport is None and agree.carries(self.transport, flat, src):
                merged = agree.rd_carrying(self.transport, flat, op, mine, workspace=self.workspace, src=src)
                algorithm = None
            else:
                merged = agree.agree(self.transport, mine)
            if merged[0] != -merged[1]:
                self._raise_if_apart("allreduce", values, merged)
        if algorithm is not None:
            algorithms.run(algorithm, transport or self.transport, flat, op, workspace=self.workspace,
                           segment_bytes=self.config.segment_bytes, src=src)
        if trial is not None and trial.record(time.perf_counter() - start):
            self._decide(trial)
        elif watch is not None and watch.record(time.perf_counter() - start):
            self._check_watch(watch)

    def allreduce(self, x, op=Op.AVERAGE, *, algorithm: str | None = None) -> np.ndarray:
        """Return a new array: ``x`` reduced with ``op`` across all ranks. Same shape and dtype."""
        if x.__class__ is np.ndarray and algorithm is None and self._box is not None:
            out = self._pair_call(x, op)
            if out is not None:
                return out
        if x.__class__ is not np.ndarray and is_device_array(x):   # a GPU array comes back on its GPU
            return device_allreduce(self, x, op, algorithm, inplace=False)
        x, op, algorithm = self._prepare(x, op, algorithm)
        # the algorithm reads x (contiguous: ravel copies only a strided array) and writes out
        out = np.empty(x.shape, x.dtype) if x.nbytes < self.results.min_bytes \
            else self.results.empty(x.size, x.dtype).reshape(x.shape)
        self._run_allreduce(out.reshape(-1), op, algorithm, src=x.ravel())
        return out

    def _pair_call(self, x: np.ndarray, op) -> np.ndarray | None:
        """The default call at p = 2 where auto keeps ``rd``: one swap through the mailbox, the
        check's head riding in it (:func:`~allreduce.algorithms.agree.pair`). It does what
        :meth:`_prepare` and :meth:`_run_allreduce` would, with their tests in the order a small
        call needs them, and sends the same messages and head, so ranks on either path agree.
        None where it does not apply (the general path then runs, or raises). It saves ~0.8 us
        of a ~4 us call (-np 2, 8 B: 3.1 against 3.8 us, raw mpi4py 1.2; issue 28)."""
        nbytes = x.nbytes
        if self.auto_picks.get(nbytes) != "rd" or not 0 < nbytes <= self._box.limit:
            return None
        config, code = self.config, _DTYPE_CODES.get(x.dtype)
        if code is None or op.__class__ is not Op or op is _ADASUM or (code == _BOOL and op is _AVERAGE) \
                or config.algorithm != "auto":
            return None
        values = mine = None
        if config.check:
            values = (0, x.size, code, op._value_, _AUTO, -1, -1, self._calls)   # as _run_allreduce's
            self._calls += 1
            mine = agree.head(values)
        out = np.empty(x.shape, x.dtype)
        merged = agree.pair(self._box, self._rank, out.ravel(), op, mine, self.workspace, x.ravel())
        if merged is not None and merged[0] != -merged[1]:
            self._raise_if_apart("allreduce", values, merged)
        return out

    def allreduce_(self, x: np.ndarray, op=Op.AVERAGE, *, algorithm: str | None = None) -> np.ndarray:
        """Reduce ``x`` in place and return it. ``x`` must be a writeable numpy array."""
        if is_device_array(x):
            return device_allreduce(self, x, op, algorithm, inplace=True)
        if not isinstance(x, np.ndarray):
            raise TypeError(f"allreduce_ works in place and needs a numpy array, got {type(x).__name__}; "
                            "use allreduce() for other inputs")
        if not x.flags.writeable:
            raise ValueError("allreduce_ cannot write into a read-only array; "
                             "use allreduce(x), which returns a new array")
        x, op, algorithm = self._prepare(x, op, algorithm)
        flat, copied = as_flat(x)
        self._run_allreduce(flat, op, algorithm)
        restore(x, flat, copied)
        return x

    def shared_empty(self, shape, dtype=np.float32) -> np.ndarray:
        """A new uninitialised array in memory every rank of the node can read (collective).

        ``allreduce_`` on it (or on a contiguous slice of it, the same slice on every rank) with
        algorithm ``shm`` reduces in place where it lies: the rank that reduces a slice reads
        it in every rank's array and writes the result into all of them, 2 bytes moved per
        byte against 4.5 for shm's copy into a shared segment and out (at p = 4). This is
        buffer registration, as in NCCL's ``ncclMemAlloc`` or PyTorch's symmetric memory.

        Every rank calls it, in the same order, with the same shape and dtype. Each call maps a
        new shared window, freed only when MPI finalizes at the process's exit (as shm's own
        segment), so allocate once and reuse. On ranks that span several nodes, where no memory
        is shared, it returns an ordinary array. ``auto`` tunes calls on such arrays apart from
        calls on private arrays of the same size (:meth:`auto_key`), so it runs the in-place
        path where that measured fastest; ``algorithm="shm"`` asks for it outright.
        """
        dtype = np.dtype(dtype)
        check_dtype(dtype, Op.SUM)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"shared_empty: negative dimension in shape {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        self.check_agreement("shared_empty", count=count, dtype=dtype_code(dtype))
        if self.size == 1:
            return np.empty(shape, dtype)
        try:
            seg = shared.allocate(self.transport, count * dtype.itemsize)
        except ValueError:          # ranks on several nodes (the same answer on every rank)
            return np.empty(shape, dtype)
        return seg.data(seg.rank, dtype, count).reshape(shape)

    # -- other collectives ------------------------------------------------------------
    def _check_root(self, root_rank: int) -> int:
        if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) \
                or not 0 <= root_rank < self.size:
            raise InvalidArgumentError(f"root_rank must be an integer in [0, {self.size}), got {root_rank!r}")
        return int(root_rank)

    def broadcast(self, x, root_rank: int = 0) -> np.ndarray:
        """Return a copy of root's ``x`` on every rank (``x`` must have root's shape and dtype)."""
        root_rank = self._check_root(root_rank)
        x = np.asarray(x)
        check_dtype(x.dtype, Op.SUM)
        out = np.array(x, order="C", copy=True)
        self.check_agreement("broadcast", count=out.size, dtype=dtype_code(out.dtype), root_rank=root_rank)
        _broadcast(self.transport, out.reshape(-1), root_rank)
        return out

    def broadcast_bytes(self, payload: bytes | None, root_rank: int = 0) -> bytes:
        """Root's ``payload`` on every rank (the length travels first)."""
        root_rank = self._check_root(root_rank)
        self.check_agreement("broadcast_object", root_rank=root_rank)
        length = np.array([len(payload) if self.rank == root_rank else 0], dtype=np.int64)
        _broadcast(self.transport, length, root_rank)
        data = np.frombuffer(payload, np.uint8).copy() if self.rank == root_rank \
            else np.empty(int(length[0]), np.uint8)
        _broadcast(self.transport, data, root_rank)
        return data.tobytes()

    def broadcast_object(self, obj: Any = None, root_rank: int = 0) -> Any:
        """Root's picklable ``obj`` on every rank."""
        payload = pickle.dumps(obj) if self.rank == root_rank else None
        return pickle.loads(self.broadcast_bytes(payload, root_rank))

    def allgather(self, x) -> np.ndarray:
        """Concatenate every rank's ``x`` along axis 0. The first dimension may differ by rank."""
        from .algorithms.allgather import allgatherv
        x = np.ascontiguousarray(x)
        check_dtype(x.dtype, Op.SUM)
        if x.ndim == 0:
            x = x.reshape(1)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        self.check_agreement("allgather")         # same collective everywhere? (rows may differ)
        rows = self._allgather_ints([x.shape[0], row, dtype_code(x.dtype), x.ndim])
        self._agree_columns("allgather", rows, {1: "elements per row (shape[1:])", 2: "dtype", 3: "ndim"})
        counts = [int(r[0]) * row for r in rows]
        out = np.empty((int(rows[:, 0].sum()),) + x.shape[1:], dtype=x.dtype)
        allgatherv(self.transport, x.reshape(-1), out.reshape(-1), counts)
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        """A list of every rank's picklable ``obj``, in rank order."""
        from .algorithms.allgather import allgatherv
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        self.check_agreement("allgather_object")
        counts = [int(n) for n in self._allgather_ints([data.size])[:, 0]]
        out = np.empty(sum(counts), np.uint8)
        allgatherv(self.transport, data, out, counts)
        offsets = np.cumsum([0] + counts)
        return [pickle.loads(out[offsets[r]:offsets[r + 1]].tobytes()) for r in range(self.size)]

    def reducescatter(self, x, op=Op.AVERAGE) -> np.ndarray:
        """Reduce ``x`` across ranks and return this rank's part of axis 0 (Horovod's split)."""
        from .algorithms.reducescatter import reducescatter as _reducescatter
        from . import partition
        x = np.array(x, order="C", copy=True)
        op = as_op(op)
        check_dtype(x.dtype, op)
        if x.ndim == 0:
            raise ValueError("reducescatter needs at least one dimension to split across ranks")
        self.check_agreement("reducescatter", count=x.size, dtype=dtype_code(x.dtype), op=int(op))
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        counts = [n * row for n in partition.chunk_sizes(x.shape[0], self.size)]
        out = np.empty(counts[self.rank], dtype=x.dtype)
        _reducescatter(self.transport, x.reshape(-1), out, counts, op, workspace=self.workspace)
        return out.reshape((counts[self.rank] // row if row else 0,) + x.shape[1:])

    def alltoall(self, x, splits=None) -> tuple[np.ndarray, np.ndarray]:
        """Send ``splits[j]`` rows (first-dimension slices) of ``x`` to rank j; return what came in.

        Args:
            x: an array with at least one dimension; rows go out in order, the first
                ``splits[0]`` to rank 0, the next ``splits[1]`` to rank 1, ...
            splits: one non-negative integer per rank summing to ``x.shape[0]``; ``None`` (or
                empty) sends ``x.shape[0] / size`` rows to each rank (then it must divide).

        Returns:
            ``(received, received_splits)``: the rows every rank sent here, in rank order, and
            how many came from each rank (int64). Bad splits on any rank raise on every rank.
        """
        from .alltoallv import alltoall as _alltoall
        return _alltoall(self, x, splits)

    def barrier(self) -> None:
        self.check_agreement("barrier")
        self.transport.barrier()

    # -- helpers ------------------------------------------------------------------------
    def _allgather_ints(self, values: list[int]) -> np.ndarray:
        mine = np.array(values, dtype=np.int64)
        table = np.empty(self.size * mine.size, np.int64)
        _allgather_blocks(self.transport, mine, table)
        return table.reshape(self.size, mine.size)

    def _agree_columns(self, what: str, rows: np.ndarray, names: dict[int, str]) -> None:
        for j, field in names.items():
            column = rows[:, j]
            if (column != column[0]).any():
                values = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
                raise MismatchError(f"{what}: {field} differs across ranks ({values})")

    def close(self) -> None:
        self.workspace.clear()
        self.transport.close()
