"""A communicator: one transport plus everything a collective call needs.

This is the boundary where user input is validated. Everything below it
(algorithms, kernels, transports) trusts its arguments. A call:

    1. checks its arguments locally: dtype, op, algorithm, root_rank
       -> ``TypeError`` / ``ValueError`` before any message is sent;
    2. allgathers a few integers of metadata (count, dtype, op, ...) so every
       rank sees every rank's call -> ``MismatchError`` on *every* rank,
       naming the ranks and their values (``check=False`` skips this). It
       is one tiny allreduce of the fields' maxima and minima; the
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
from .algorithms.allgather import allgather as _allgather_blocks
from .algorithms.broadcast import broadcast as _broadcast
from .auto import _ALGO_CODES, SMALL_BYTES, AutoChooser
from .autotune import AutoTuner
from .buffers import ResultPool, Workspace, as_flat, device_allreduce, is_device_array, restore
from .config import ALGORITHM_NAMES, Config
from .errors import InvalidArgumentError, MismatchError
from .ops import Op, as_op, check_dtype, dtype_code
from .transport import shared
from .transport.base import Transport

__all__ = ["Communicator"]

_FIELDS = ("count", "dtype", "op", "algorithm", "root_rank", "shared")
_SHOW = {"dtype": lambda c: str(np.dtype(_dtype_name(c))), "op": lambda c: repr(Op(c)),
         "algorithm": lambda c: ALGORITHM_NAMES[c],
         "shared": lambda c: "a private array" if c < 0 else f"shared_empty memory at byte {c}"}


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

        The common case, agreement, costs one tiny allreduce: the elementwise
        MAX of ``[fields, -fields]`` gives every field's maximum and minimum
        at once, and they are equal exactly when all ranks agree (recursive
        doubling: log2 p messages, not an allgather's p - 1; not native
        ``MPI_Allreduce``, whose wait has no timeout, so a silent peer would
        hang the check forever). Only on a mismatch, and then on every rank
        alike, does it allgather the fields to name each rank's value.
        """
        if not self.config.check or self.size == 1:
            return
        values = [fields.get(f, -1) for f in _FIELDS]
        k = len(values)
        bounds = np.array(values + [-v for v in values], dtype=np.int64)   # a handful of ints: Python
        algorithms.get("rd")(self.transport, bounds, Op.MAX, workspace=self.workspace, segment_bytes=0)
        top = bounds.tolist()                                              # lists beat numpy ops here
        if top[:k] == [-v for v in top[k:]]:
            return
        mine = np.array(values, dtype=np.int64)
        table = self.workspace.get("check", self.size * mine.size, np.int64)
        _allgather_blocks(self.transport, mine, table)
        table = table.reshape(self.size, mine.size)
        problems = []
        for j, field in enumerate(_FIELDS):
            column = table[:, j]
            if (column != column[0]).any():
                show = _SHOW.get(field, str)
                values = ", ".join(f"rank {r}: {show(int(v))}" for r, v in enumerate(column))
                problems.append(f"{field} differs across ranks ({values})")
        raise MismatchError(f"{what}: " + "; ".join(problems)
                            + ". Every rank must call the same collective with the same arguments.")

    # -- allreduce ---------------------------------------------------------------------
    def _prepare(self, x, op, algorithm: str | None) -> tuple[np.ndarray, Op, str]:
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        op = as_op(op)
        check_dtype(x.dtype, op)
        algorithm = self.config.algorithm if algorithm is None else algorithm
        if algorithm not in _ALGO_CODES:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHM_NAMES)}")
        return x, op, algorithm

    def _run_allreduce(self, flat: np.ndarray, op: Op, algorithm: str, transport: Transport | None = None,
                       src: np.ndarray | None = None) -> None:
        """Reduce into ``flat``: its own contents, or ``src``'s (an out-of-place call)."""
        if self.config.check and self.size > 1:
            registered = shared.find(self.transport, flat) if src is None else None
            self.check_agreement("allreduce", count=flat.size, dtype=dtype_code(flat.dtype), op=int(op),
                                 algorithm=_ALGO_CODES[algorithm], shared=-1 if registered is None else registered[1])
        trial = watch = None
        if algorithm == "auto":
            # a kept pick under SMALL_BYTES is neither watched nor registered: one lookup (~3% of a 4 us call)
            algorithm = self.auto_picks.get(flat.nbytes) if flat.nbytes < SMALL_BYTES else None
            if algorithm is None:
                algorithm, trial, watch = self.auto_resolve(flat, src, transport)
        start = time.perf_counter() if trial is not None or watch is not None else 0.0
        algorithms.run(algorithm, transport or self.transport, flat, op, workspace=self.workspace,
                       segment_bytes=self.config.segment_bytes, src=src)
        if trial is not None and trial.record(time.perf_counter() - start):
            self._decide(trial)
        elif watch is not None and watch.record(time.perf_counter() - start):
            self._check_watch(watch)

    def allreduce(self, x, op=Op.AVERAGE, *, algorithm: str | None = None) -> np.ndarray:
        """Return a new array: ``x`` reduced with ``op`` across all ranks. Same shape and dtype."""
        if is_device_array(x):    # a GPU array comes back as the same type, on the same GPU
            return device_allreduce(self, x, op, algorithm, inplace=False)
        x, op, algorithm = self._prepare(x, op, algorithm)
        out = self.results.empty(x.size, x.dtype).reshape(x.shape)   # the algorithm reads x, writes out
        self._run_allreduce(out.reshape(-1), op, algorithm, src=np.ascontiguousarray(x).reshape(-1))
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
