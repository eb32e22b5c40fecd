"""The process-wide default communicator behind ``ar.init()`` and friends.

``import allreduce as ar; ar.init()`` builds one :class:`Communicator` over
MPI (``COMM_WORLD`` or the ``comm`` given) and every module-level function
forwards to it. Calling a collective before ``init()`` or after
``shutdown()`` raises :class:`~allreduce.errors.NotInitializedError`.

``init()`` also starts the engine (``allreduce/engine/``): a background
thread with its own MPI communicator that runs every named allreduce
(``allreduce_async``, ``grouped_allreduce``, ``allreduce(x, name=...)``):
negotiated across ranks, fused and optionally compressed. Without a name,
``allreduce`` is the direct, blocking path of :class:`Communicator`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .comm import Communicator
from .config import Config
from .engine import Compression, Engine, Handle
from .engine.handle import GroupedHandle
from .errors import AllreduceError, InvalidArgumentError, MismatchError, NotInitializedError
from .ops import Op

__all__ = ["init", "shutdown", "is_initialized", "communicator", "rank", "size", "local_rank",
           "local_size", "allreduce", "allreduce_", "broadcast", "allgather", "reducescatter",
           "alltoall", "broadcast_object", "allgather_object", "barrier", "explain_choice",
           "allreduce_async", "grouped_allreduce", "synchronize", "join", "shared_empty", "start_timeline",
           "stop_timeline"]

_current: Communicator | None = None
_engine: Engine | None = None


def _node_layout(mpi_comm, fake_node_size: int) -> tuple[int, int, int]:
    """``(local_rank, local_size, nodes)``: this rank's place among the ranks on its node, and the
    number of real nodes (MPI's placement, whatever ``fake_node_size`` pretends)."""
    from mpi4py import MPI
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        nodes = mpi_comm.allreduce(int(local.Get_rank() == 0))
        if fake_node_size:
            rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
            node = rank // fake_node_size
            return rank % fake_node_size, min(fake_node_size, size - node * fake_node_size), nodes
        return local.Get_rank(), local.Get_size(), nodes
    finally:
        local.Free()


def _link(transport, config: Config, nodes: int):
    """The inter-node link ``auto`` prices (:mod:`allreduce.algorithms.network`): ``ALLREDUCE_LINK``
    if set, else measured once here (collective) when the job spans real nodes; None on one node."""
    from .algorithms import network
    try:
        link = network.parse_link(config.link) if config.link else None
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    if nodes <= 1:
        return None
    if link is None:
        from mpi4py import MPI
        local = transport.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:                                       # a node is named by its lowest rank
            node_ids = transport.comm.allgather(local.allreduce(transport.rank, op=MPI.MIN))
        finally:
            local.Free()
        link = network.probe(transport, node_ids)
    return link


def init(comm=None, **settings: Any) -> Communicator:
    """Start the library on every rank of ``comm`` (an mpi4py communicator; default COMM_WORLD).

    Keyword arguments override :class:`~allreduce.config.Config` fields and
    the ``ALLREDUCE_*`` environment. Calling ``init()`` again is a no-op that
    returns the existing communicator.
    """
    global _current, _engine
    if _current is not None:
        return _current
    from .transport.mpi import ENGINE_MAX_PAUSE, ENGINE_SPINS, MPITransport
    config = Config.from_env(**settings)
    # Small swaps through shared memory where the job is one node, and not one standing in for
    # several (fake nodes; --mca btl tcp,self): allreduce/transport/mailbox.py.
    mailbox = config.shm_p2p and not config.fake_node_size
    transport = MPITransport(comm, timeout=config.timeout, mailbox=mailbox, elastic=config.elastic)
    transport.fake_node_size = config.fake_node_size      # hierarchical's node layout, for testing
    local_rank, local_size, nodes = _node_layout(transport.comm, config.fake_node_size)
    transport.nodes, transport.link = nodes, _link(transport, config, nodes)   # auto across real nodes
    from . import faults
    faults.install(transport.rank, transport.size)   # an uncaught exception aborts every rank, naming this one
    current = Communicator(transport, config=config, local_rank=local_rank, local_size=local_size)
    if config.engine:
        from mpi4py import MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            current.close()
            raise AllreduceError("the allreduce engine runs MPI from a background thread and needs "
                                 "MPI thread level MULTIPLE (mpi4py's default, mpi4py.rc.thread_level = "
                                 "'multiple'); this MPI was initialised with a lower level. Set "
                                 "ALLREDUCE_ENGINE=0 to run without the engine.")
        try:   # its own duplicate communicator: engine messages never match the direct path's
            engine_transport = MPITransport(transport.comm, timeout=config.timeout, spins=ENGINE_SPINS,
                                            max_pause=ENGINE_MAX_PAUSE, mailbox=mailbox, elastic=config.elastic)
            engine_transport.fake_node_size = config.fake_node_size
            engine_transport.nodes, engine_transport.link = transport.nodes, transport.link
            _engine = Engine(engine_transport, config=config, local_size=local_size)
        except BaseException:
            current.close()
            raise
    _current = current
    return _current


def shutdown() -> None:
    """Stop the engine and release the communicator. Calls raise until ``init()`` is called again.

    Named tensors ready on every rank are still reduced; the handles of the
    others fail with ``ShutdownError``. The engine thread has exited when
    this returns.
    """
    global _current, _engine
    if _engine is not None:
        engine_, _engine = _engine, None
        engine_.shutdown()
    if _current is not None:
        current, _current = _current, None
        current.close()


def is_initialized() -> bool:
    return _current is not None


def communicator() -> Communicator:
    """The communicator ``init()`` built; raises ``NotInitializedError`` before it."""
    if _current is None:
        raise NotInitializedError("allreduce is not initialized: call ar.init() first "
                                  "(or again, after ar.shutdown())")
    return _current


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    return communicator().local_rank


def local_size() -> int:
    return communicator().local_size


def _running_engine() -> Engine:
    """The engine ``init()`` started; raises ``NotInitializedError`` before it (or with ALLREDUCE_ENGINE=0)."""
    communicator()
    if _engine is None:
        raise NotInitializedError("the allreduce engine is not running: it is off (ALLREDUCE_ENGINE=0 "
                                  "or init(engine=False)); named and asynchronous allreduce need it")
    return _engine


def _engine_path(name, compression, algorithm, comm_hook=None) -> bool:
    if name is None and (compression is None or compression is Compression.none) and comm_hook is None:
        return False
    if algorithm is not None:
        raise InvalidArgumentError("algorithm= applies to the direct path only; a named or compressed "
                                   "allreduce goes through the engine, which picks an algorithm per fused "
                                   "batch (set ALLREDUCE_ALGORITHM to force one)")
    return True


def allreduce(x, op=Op.AVERAGE, algorithm: str | None = None, name: str | None = None,
              compression=Compression.none, comm_hook=None) -> np.ndarray:
    """Return ``x`` reduced with ``op`` over all ranks, as a new array of the same shape and dtype.

    Args:
        x: a numpy array (any shape, contiguous or not) of a supported dtype.
        op: ``ar.Sum``, ``ar.Average`` (default), ``ar.Min``, ``ar.Max`` or ``ar.Product``.
        algorithm: ``"auto"`` (default from config), ``"ring"``, ``"tree"``, ``"rhd"``, ``"rd"`` or ``"mpi"``
            (direct path only).
        name: with a name (or a compression) the call goes through the engine: negotiated, fused,
            and it may be submitted in a different order on different ranks.
        compression: ``ar.Compression.none`` (default), ``.fp16``, ``.bf16`` or your own compressor.
        comm_hook: an ``ar.CommHook`` (``ar.PowerSGD(...)``, ``ar.OneBit()``): the engine runs it.

    Returns:
        The reduced array; bitwise identical on every rank.
    """
    if _engine_path(name, compression, algorithm, comm_hook):
        return allreduce_async(x, name=name, op=op, compression=compression, comm_hook=comm_hook).wait()
    return communicator().allreduce(x, op, algorithm=algorithm)


def allreduce_(x: np.ndarray, op=Op.AVERAGE, algorithm: str | None = None, name: str | None = None,
               compression=Compression.none) -> np.ndarray:
    """In-place :func:`allreduce`: ``x`` (writeable numpy array) receives the result and is returned."""
    if _engine_path(name, compression, algorithm):
        if not isinstance(x, np.ndarray) or not x.flags.writeable:
            raise InvalidArgumentError("allreduce_ needs a writeable numpy array; use allreduce(x)")
        return allreduce_async_(x, name=name, op=op, compression=compression).wait()
    return communicator().allreduce_(x, op, algorithm=algorithm)


def allreduce_async(x, name: str | None = None, op=Op.AVERAGE, compression=Compression.none,
                    comm_hook=None) -> Handle:
    """Start an allreduce in the engine and return its handle at once.

    Args:
        x: a numpy array; do not modify it until the handle is done.
        name: the tensor's name, the same on every rank (ranks may submit names in any order).
            ``None`` names it by call order, which then must be the same on every rank.
        op: ``ar.Average`` (default), ``ar.Sum``, ``ar.Min``, ``ar.Max`` or ``ar.Product``.
        compression: ``ar.Compression.none`` (default), ``.fp16``, ``.bf16`` or your own compressor.
        comm_hook: an ``ar.CommHook`` that reduces the tensor's fused bucket instead
            (``ar.PowerSGD(...)``, ``ar.OneBit()``; allreduce/engine/hooks.py). Then
            ``compression`` must be none, and ``name`` given: the hook keeps its state per
            name. The same hook settings on every rank, else ``MismatchError`` on every rank.

    Returns:
        A :class:`~allreduce.engine.Handle`: ``wait()`` returns the result, ``done()`` polls.
    """
    return _running_engine().submit(x, name=name, op=op, compression=compression, comm_hook=comm_hook)


def allreduce_async_(x: np.ndarray, name: str | None = None, op=Op.AVERAGE,
                     compression=Compression.none, comm_hook=None) -> Handle:
    """In-place :func:`allreduce_async` (Horovod's ``allreduce_async_``): the result goes into ``x``.

    ``x`` must be a writeable numpy array; it is read-only until the handle is
    done, and ``wait()`` returns ``x`` itself. A large uncompressed tensor is
    reduced straight in ``x`` (no fusion-buffer copies), which is what a
    training loop with persistent gradient buffers wants.
    """
    return _running_engine().submit(x, name=name, op=op, compression=compression, comm_hook=comm_hook,
                                    inplace=True)


def join() -> int:
    """Horovod's ``hvd.join()``: this rank has run out of data; block until every rank has joined.

    Until then the other ranks' named allreduces go on, this rank taking part in each with zeros
    of the agreed shape and dtype. ``Average`` divides by the full size, joined ranks included
    (Horovod's rule: with one of 4 ranks joined the result is the active ranks' sum / 4).
    ``allgather``, ``broadcast`` and ``alltoall`` raise ``MismatchError`` on a rank that knows
    another has joined, as Horovod's do; a rank learns it in its engine's next cycle (any
    allreduce finished since the join guarantees it). Joining again after every rank has
    joined starts over.

    Returns:
        The last rank to join (the highest of those that joined in the same engine cycle).
    """
    return _running_engine().join()


def _unjoined(what: str) -> Communicator:
    """The communicator, for a collective that every rank must enter itself: refused while a
    rank is known to have joined (it waits in ``join()`` and would never enter it)."""
    current = communicator()
    joined = _engine.joined_ranks if _engine is not None else frozenset()
    if joined:
        raise MismatchError(f"rank {current.rank}: {what} is not supported while rank(s) "
                            f"{', '.join(map(str, sorted(joined)))} have joined (as in Horovod, only "
                            "allreduce goes on with a joined rank's zeros); call it before join() or "
                            "after every rank has joined")
    return current


def synchronize(handle: Handle) -> np.ndarray:
    """Wait for ``handle`` and return its result (Horovod's ``hvd.synchronize``)."""
    return handle.wait()


def start_timeline(path: str, mark_cycles: bool = False) -> None:
    """Start writing the engine's Chrome-trace timeline to ``path`` on this rank (Horovod's
    ``hvd.start_timeline``; rank r > 0 writes ``stem.rank<r>.suffix`` beside it, as with
    ``ALLREDUCE_TIMELINE``). ``mark_cycles``: a ``CYCLE_START`` tick per engine cycle."""
    _running_engine().start_timeline(str(path), mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Finish and close the timeline file started by :func:`start_timeline` (or ``ALLREDUCE_TIMELINE``)."""
    _running_engine().stop_timeline()


def grouped_allreduce(xs, name: str | None = None, op=Op.AVERAGE,
                      compression=Compression.none, comm_hook=None) -> list[np.ndarray]:
    """Reduce a list of arrays; return the list of results (the tensors are fused when they fit).

    The arrays of each dtype are one engine tensor (Horovod's groups): packed back to back once,
    negotiated under one name with one bit, reduced in one allreduce, and returned as views of
    its result. 1000 tensors cost about one allreduce of their bytes, not 1000 submits.

    Args:
        xs: a list of numpy arrays (any shapes; every rank passes the same shapes in the same order).
        name: the group's name (a group of several dtypes: ``f"{name}.{dtype}"`` per dtype).
            ``None`` names it by call order.
        op: the op for every tensor.
        compression: the compressor for every tensor.
        comm_hook: an ``ar.CommHook`` for every tensor (see :func:`allreduce_async`). A hook that
            is not a compressor sees each array as its own tensor (``f"{name}.{i}"``; PowerSGD
            needs each one's shape), and the engine fuses them into its buckets.

    Returns:
        The reduced arrays, in the order of ``xs``.
    """
    return grouped_allreduce_async(xs, name=name, op=op, compression=compression, comm_hook=comm_hook).wait()


def grouped_allreduce_async(xs, name: str | None = None, op=Op.AVERAGE,
                            compression=Compression.none, comm_hook=None) -> GroupedHandle:
    """:func:`grouped_allreduce` without blocking (Horovod's ``grouped_allreduce_async``).

    Returns:
        A :class:`~allreduce.engine.handle.GroupedHandle`: ``wait()`` (or :func:`synchronize`)
        returns the reduced arrays in the order of ``xs``.
    """
    eng = _running_engine()
    arrays = [x if isinstance(x, np.ndarray) else np.asarray(x) for x in xs]
    # Adasum's coefficients, and a hook's view of each tensor (PowerSGD's matrices), belong to
    # each tensor: no packing into one vector
    if op is Op.ADASUM or (comm_hook is not None and not getattr(comm_hook, "direct_ok", True)):
        parts = [([i], eng.submit(x, name=None if name is None else f"{name}.{i}", op=op, compression=compression,
                                  comm_hook=comm_hook))
                 for i, x in enumerate(arrays)]
        return GroupedHandle(name, parts, len(arrays))
    groups: dict[np.dtype, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(x.dtype, []).append(i)
    parts = []
    for dtype, members in groups.items():
        label = name if name is None or len(groups) == 1 else f"{name}.{dtype}"
        parts.append((members, eng.submit_group([arrays[i] for i in members], name=label, op=op,
                                                compression=compression, comm_hook=comm_hook)))
    return GroupedHandle(name, parts, len(arrays))


def broadcast(x, root_rank: int = 0) -> np.ndarray:
    """Root's ``x`` on every rank (a new array)."""
    return _unjoined("broadcast").broadcast(x, root_rank)


def allgather(x) -> np.ndarray:
    """Every rank's ``x`` concatenated along axis 0, in rank order."""
    return _unjoined("allgather").allgather(x)


def reducescatter(x, op=Op.AVERAGE) -> np.ndarray:
    """Reduce ``x`` and keep this rank's slice of axis 0."""
    return communicator().reducescatter(x, op)


def alltoall(x, splits=None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[j]`` rows of ``x`` to rank j (equal shares without splits); return
    ``(received rows, received splits)``. See :meth:`Communicator.alltoall`."""
    return _unjoined("alltoall").alltoall(x, splits)


def broadcast_object(obj: Any = None, root_rank: int = 0) -> Any:
    """Root's picklable ``obj`` on every rank."""
    return _unjoined("broadcast_object").broadcast_object(obj, root_rank)


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, as a list in rank order."""
    return _unjoined("allgather_object").allgather_object(obj)


def explain_choice(nbytes: int) -> str:
    """What ``algorithm="auto"`` would pick for ``nbytes`` here, and every algorithm's predicted time
    (plus, once the run-time tuner has timed this size on this communicator, what it measured and kept).

    Args:
        nbytes: message size in bytes.

    Returns:
        A table as text, fastest first, with auto's choice marked.
    """
    from .algorithms.explain_choice import explain_choice as _explain
    c = communicator()
    text = _explain(nbytes, c.size, local_size=c.local_size, path=c.config.costmodel,
                    candidates=c.auto_candidates, nodes=c.nodes, link=c._link)
    tried = c.tuner.decided.get(nbytes) if c.tuner is not None else None
    if tried:     # the run-time tuner has measured this size (allreduce/autotune.py): that decides
        text += (f"\n  measured at run time (us, best block's mean, slowest rank): "
                 + ", ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in tried.items())
                 + f"; auto now runs {c.auto_picks[nbytes]}")
    elif c.auto_picks.get(nbytes, c.choose(nbytes)) != c.choose(nbytes):
        text += (f"\n  auto runs {c.auto_picks[nbytes]}: rank 0's cost model picks it, and every rank "
                 "runs rank 0's pick")
    return text


def shared_empty(shape, dtype=np.float32) -> np.ndarray:
    """An array whose memory every rank of the node can read (collective: every rank calls it with
    the same shape and dtype). ``allreduce_(x, algorithm="shm")`` on it skips the copy into shared
    memory: see :meth:`Communicator.shared_empty`."""
    return communicator().shared_empty(shape, dtype)


def barrier() -> None:
    """Wait until every rank arrives."""
    communicator().barrier()
