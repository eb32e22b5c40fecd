"""The engine: one background thread per process that owns every named allreduce.

::

    user threads                         engine thread (every cycle_time ms)
    ------------                         -----------------------------------
    allreduce_async(x, name) --queue-->  1. drain the queue into `pending`
         returns a Handle                2. negotiate: which names are ready on ALL ranks
                                            (one small allreduce; see negotiation.py)
    handle.wait() <-------- result ----  3. fuse the ready ones into batches and run each
                                            batch's comm hook: for the compressors (none,
                                            fp16, bf16) one allreduce (fusion.py), for
                                            PowerSGD / OneBit their own collectives (hooks.py)

The engine talks over its own transport (for MPI: its own duplicate of the
communicator, so its messages can never match the direct path's), its own
:class:`~allreduce.comm.Communicator` and workspace. Every rank runs the
same cycles in lockstep: each cycle's exchange is a collective.

Tests run p engines as p threads over one ``ThreadWorld``::

    world = ThreadWorld(4)
    engines = [Engine(world.transport(r), config=Config(cycle_time=0.5)) for r in range(4)]
    handles = [e.submit(np.ones(3), name="x") for e in engines]

Shutdown on any rank stops every rank's engine at the same cycle: tensors
ready everywhere are still reduced, the rest fail with ``ShutdownError``.

:meth:`Engine.join` is Horovod's ``join()`` for uneven data: this rank has
no more batches; it blocks while the other ranks' allreduces go on, with
zeros in its place (negotiation.py), and returns the last rank to join.

This file is what the caller's thread runs (submit, admit, join, shutdown);
the cycle, on the engine's own thread, is :mod:`.cycle`. When cycles run
(early on a burst of submits, stretched while idle) is :mod:`.pacing`'s job.
"""
from __future__ import annotations

import threading

import numpy as np

from ..algorithms import adasum
from ..comm import Communicator
from ..config import Config
from ..errors import InvalidArgumentError, ShutdownError
from ..ops import Op, as_op, check_dtype
from ..transport.base import Transport
from .compression import check_compressor
from .cycle import EngineThread, log
from .fusion import DIRECT_BYTES, MANY_DIRECT_BYTES, Fusion
from .handle import Entry, GroupHandle, Handle
from .hooks import HookComm, resolve
from .negotiation import Negotiator
from .pacing import Pacer
from .reducer import Reducer
from .stall import StallInspector
from .timeline import Timeline, TimelineTransport, timeline_path

__all__ = ["Engine"]


class Engine(EngineThread):
    """The background allreduce engine of one rank, over ``transport``.

    Args:
        transport: this rank's transport; the engine owns it from now on and closes it.
        config: settings (``cycle_time``, ``fusion_threshold``, ``timeline``, ...).
        local_size: ranks on this node (default: all), for ``auto``'s choice of ``shm``.
    """

    def __init__(self, transport: Transport, *, config: Config | None = None, local_size: int | None = None):
        self.config = config = config or Config()
        if config.algorithm == "mpi" and getattr(transport, "comm", None) is None:
            raise InvalidArgumentError(f"rank {transport.rank}: algorithm 'mpi' needs the MPI transport; this "
                                       f"engine runs on {type(transport).__name__} (use auto, ring, tree, rhd "
                                       "or rd)")
        self.rank, self.size = transport.rank, transport.size
        self.timeline = Timeline(timeline_path(config.timeline, self.rank), self.rank) \
            if config.timeline else None
        self.transport = TimelineTransport(transport) if self.timeline else transport
        self.comm = Communicator(self.transport, config=config, local_size=local_size, cold=True)
        self.reducer = reducer = Reducer(self.transport, self.comm, config)
        self.negotiator = Negotiator(self.rank, self.size, reducer.control, self.comm.allgather_object,
                                     capacity=config.cache_capacity)
        self.many = reducer.many                          # shm on one node: see Reducer.allreduce_many
        self.direct_bytes = MANY_DIRECT_BYTES if self.many else DIRECT_BYTES
        self.fusion = Fusion(self.rank, self.size, reducer.allreduce, self.comm.workspace, self.timeline,
                             self.transport if self.timeline else None, control=reducer.control,
                             allreduce_many=reducer.allreduce_many)
        self.hook_comm = HookComm(self.transport, self.comm, reducer, self.fusion, self.timeline)
        self.stall = StallInspector(self.rank, self.size, check_time=config.stall_check_time,
                                    shutdown_time=config.stall_shutdown_time,
                                    out_of_step_time=config.out_of_step_time)
        self.pending: dict[str, Entry] = {}
        self.cycles = 0                                   # cycles run (a statistic for tests)
        self._lock = threading.Lock()
        self._queue: list[Entry] = []
        self._inflight: set[str] = set()
        self._stopping = False
        self._stopped: BaseException | None = None        # why the engine no longer accepts work
        self._join: Handle | None = None                  # this rank's join, until every rank has joined
        self._join_queued = False
        self.pacer = Pacer(config.cycle_time / 1000.0)
        self._hurry = self.pacer.hurry                    # one bound method for every handle
        self._checked: tuple = (None, None, None, None, None)   # submit's last checked combination
        self._unnamed = 0
        self._served = False                              # the last cycle completed handles
        self._thread = threading.Thread(target=self._run, name=f"allreduce-engine-rank{self.rank}", daemon=True)
        self._thread.start()

    # -- the user side -------------------------------------------------------------------
    def submit(self, x, *, name: str | None = None, op=Op.AVERAGE, compression=None,
               comm_hook=None, inplace: bool = False) -> Handle:
        """Queue ``x`` for an allreduce under ``name``; return its :class:`Handle` at once.

        Args:
            x: a numpy array of a supported dtype. Do not modify it until the handle is done.
            name: the same on every rank for the same tensor; ``None`` names tensors by call
                order (``allreduce.noname.<n>``), which needs every rank to call in the same order.
            op: ``ar.Average`` (default), ``ar.Sum``, ``ar.Min``, ``ar.Max`` or ``ar.Product``.
            compression: ``ar.Compression.none`` (default), ``.fp16``, ``.bf16`` or your own.
            comm_hook: an :class:`~allreduce.engine.hooks.CommHook` (``ar.PowerSGD()``,
                ``ar.OneBit()``, ...) that reduces the tensor's bucket instead; then
                ``compression`` must be none. Every rank must pass equal settings.
            inplace: write the result into ``x`` (a writeable numpy array) and return ``x``.
                A large plain tensor is then reduced in ``x`` itself, with no copy at all.

        Returns:
            A handle; ``handle.wait()`` returns the reduced array.
        """
        # The checks depend only on (dtype, op, compression): the last combination that passed them
        # is recognised by identity (~0.1 us) instead of checked again (~0.6 us of a ~2 us submit).
        if comm_hook is not None:
            compression = resolve(compression, comm_hook, self.rank)
            if name is None and not compression.direct_ok:
                raise InvalidArgumentError(f"rank {self.rank}: comm hook {compression.name} keeps its state "
                                           "(errors, warm starts, step counts) per tensor name; name the "
                                           "tensor (the same name every step)")
        checked = self._checked
        if not (x.__class__ is np.ndarray and x.dtype is checked[0] and op is checked[1]
                and compression is checked[2] and (not inplace or x.flags.writeable)):
            x, checked = self._check(x, op, compression, inplace)
        if name is not None and (name.__class__ is not str or not name):
            self._check_name(name)
        entry = Entry(name, x, checked[3], checked[4], self._hurry, inplace)   # copies a non-contiguous x first
        if comm_hook is not None and compression.keeps_state:   # its settings and its state's age (hooks.py)
            entry.meta = entry.meta[:3] + (compression.agreement(name, self.comm),)
        self._enqueue(entry)
        return entry                                     # the caller's handle

    def _check(self, x, op, compression, inplace: bool) -> tuple:
        """Validate one submit's array, op and compression (raising the user's error); return the
        array (as numpy) and ``(dtype, op as given, compression as given, op, compressor)``."""
        if inplace and not (isinstance(x, np.ndarray) and x.flags.writeable):
            raise InvalidArgumentError(f"rank {self.rank}: an in-place allreduce needs a writeable numpy "
                                       f"array, got {'a read-only array' if isinstance(x, np.ndarray) else type(x).__name__}")
        x = x if isinstance(x, np.ndarray) else np.asarray(x)
        given = op
        op = as_op(op)
        check_dtype(x.dtype, op)
        if op is Op.ADASUM:
            adasum.check(self.size, x.dtype, self.rank)     # every rank raises alike, nothing queued
        compressor = check_compressor(compression)
        compressor.check(x.dtype, op, self.rank)            # a hook's dtypes and ops
        checked = (x.dtype, given, compression, op, compressor)
        if given is op:                                     # an integer op is converted every time
            self._checked = checked
        return x, checked

    def submit_group(self, xs, *, name: str | None = None, op=Op.AVERAGE, compression=None,
                     comm_hook=None) -> GroupHandle:
        """Queue a list of arrays of one dtype as one tensor; return a :class:`GroupHandle`.

        The arrays are packed back to back here, once (one copy, in the caller's thread), and
        from then on they are one engine tensor: one name, one negotiation bit, one result that
        ``wait()`` hands back as one view per array. Every rank must group the same shapes in
        the same order; a difference fails the group on every rank, naming the shapes.
        A comm hook that needs each tensor's shape (PowerSGD) cannot take a group: submit its
        arrays one by one (``ar.grouped_allreduce`` does).
        """
        arrays = [x if isinstance(x, np.ndarray) else np.asarray(x) for x in xs]
        if not arrays:
            raise InvalidArgumentError(f"rank {self.rank}: a group needs at least one array")
        op = as_op(op)
        dtype = check_dtype(arrays[0].dtype, op)
        if op is Op.ADASUM:
            adasum.check(self.size, dtype, self.rank)
        for i, a in enumerate(arrays):
            if a.dtype != dtype:
                raise InvalidArgumentError(f"rank {self.rank}: a group has one dtype, but array {i} is "
                                           f"{a.dtype} and array 0 {dtype}; group each dtype apart")
        compressor = check_compressor(resolve(compression, comm_hook, self.rank))
        if not compressor.direct_ok:
            raise InvalidArgumentError(f"rank {self.rank}: a group is one flat tensor, and comm hook "
                                       f"{compressor.name} reduces each tensor by its shape; submit the "
                                       "arrays one by one (ar.grouped_allreduce does)")
        self._check_name(name)
        joint = np.concatenate(arrays, axis=None)                # flattens and packs in one pass
        shapes = [tuple(a.shape) for a in arrays]
        entry = Entry(name, joint, op, compressor, self._hurry, inplace=True)  # our own copy: reduced in it
        entry.meta = (tuple(shapes),) + entry.meta[1:]
        self._enqueue(entry)
        return GroupHandle(entry, shapes, [a.size for a in arrays])

    @staticmethod
    def _check_name(name) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidArgumentError(f"name must be a non-empty string, got {name!r}")

    def _enqueue(self, entry: Entry) -> None:
        name = entry.name
        lock = self._lock
        lock.acquire()                      # not ``with``: its __enter__/__exit__ cost ~0.08 us a tensor
        try:
            if self._stopping or self._stopped is not None or name is None or name in self._inflight:
                name = self._admit(entry)           # the rare cases: refused (raises) or named here
            self._inflight.add(name)
            self._queue.append(entry)
        finally:
            lock.release()
        self.pacer.submitted()              # the engine starts a cycle once this burst of submits ends

    def _admit(self, entry: Entry) -> str:
        """Under the submit lock: raise if the engine is shut down or the name is in flight (the
        caller's array is its own again); name an unnamed tensor. Returns its name."""
        if self._stopped is not None or self._stopping:
            entry.release()
            # the reason's type in the text and as the cause: an elastic run knows a peer's death
            # by them (tfops' by the text, which is all TensorFlow keeps of a callback's error)
            why = self._stopped
            raise ShutdownError(f"rank {self.rank}: the allreduce engine is shut down"
                                + (f" ({type(why).__name__}: {why})" if why else "")
                                + "; call ar.init() again to restart it") from why
        name = entry.name
        if name is None:
            entry.name = name = f"allreduce.noname.{self._unnamed}"
            self._unnamed += 1
        if name in self._inflight:
            entry.release()
            raise InvalidArgumentError(f"rank {self.rank}: a tensor named {name!r} is already in flight; "
                                       "wait for its handle before submitting the name again")
        return name

    def join(self, timeout: float | None = None) -> int:
        """Horovod's ``join()``: this rank has run out of data. Block until every rank has joined.

        Meanwhile the other ranks' allreduces go on: this rank takes part in each with zeros of
        the agreed shape and dtype, so ``Average`` divides the active ranks' sum by the full
        size (Horovod's rule), and Min, Max and Product see zeros too. Allgather and broadcast
        fail on the ranks that call them while a rank is joined (``ar.allgather``), as
        Horovod's do. Once every rank has joined, every rank's ``join`` returns, and the next
        join starts over.

        Returns:
            The last rank to join (the highest of those that joined in the same cycle).
        """
        return self.join_async().wait(timeout)

    def join_async(self) -> Handle:
        """:meth:`join` without blocking: its handle's ``wait()`` returns the last rank to join."""
        with self._lock:
            if self._stopped is not None or self._stopping:
                raise ShutdownError(f"rank {self.rank}: the allreduce engine is shut down")
            if self._join is not None:
                raise InvalidArgumentError(f"rank {self.rank}: join() is already in progress on this rank")
            self._join = handle = Handle("allreduce.join", self.pacer.hurry)
            self._join_queued = True
        self.pacer.submitted()
        return handle

    # -- the timeline, started and stopped at run time (hvd.start_timeline / stop_timeline) -------
    mark_cycles = False                                   # a CYCLE_START tick per cycle on the timeline

    def start_timeline(self, path: str, *, mark_cycles: bool = False) -> None:
        """Write the timeline to ``path`` from now on (rank r > 0: see ``timeline_path``), replacing
        the current one. Per-step phases are traced only when the timeline was on from ``init``
        (``ALLREDUCE_TIMELINE``): they need the transport wrapped from the start."""
        old, self.timeline = self.timeline, Timeline(timeline_path(path, self.rank), self.rank)
        self.fusion.timeline = self.hook_comm.timeline = self.timeline
        self.mark_cycles = mark_cycles
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        """Close the timeline file. The closed timeline stays in place and ignores events, so the
        engine thread, which may be writing to it right now, never sees it vanish mid-cycle."""
        self.mark_cycles = False
        if self.timeline is not None:
            self.timeline.close()

    @property
    def joined_ranks(self) -> frozenset[int]:
        """The ranks this rank's engine knows to have joined (empty once every rank has)."""
        return self.negotiator.joined

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine on every rank (at the same cycle) and join its thread.

        Tensors ready on every rank are still reduced; every other pending
        handle fails with ``ShutdownError``. Idempotent.
        """
        with self._lock:
            self._stopping = True
        self.pacer.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(self.config.timeout + 5 if timeout is None else timeout)
        if self._thread.is_alive():
            log.warning("rank %d: the engine thread did not stop within the timeout; its peers may "
                        "have died. Failing its handles.", self.rank)
            self._fail_all(ShutdownError(f"rank {self.rank}: engine shut down while a peer was unresponsive"))

    @property
    def alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive()
