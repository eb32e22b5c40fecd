"""Everything the benchmark can time, behind one interface: ``make_runner(name, ctx)``.

A runner is ``run(x) -> result``: one collective on this rank's input ``x``.
Allreduce works in place (``x`` is the result); the other collectives return
a new array. Names:

==============  ==============================================================
ring tree rhd   our algorithms, through ``Communicator.allreduce_(algorithm=)``
rd mpi shm ...  ("mpi" is our wrapper around MPI_Allreduce: native.py; "auto"
                lets the cost model choose per call)
shm-reg         shm on a registered buffer (``Communicator.shared_empty``): the
                input is copied once into shared memory that peers read in
                place, as nccl-tests' ``-R 1`` times NCCL with registered buffers
ours            our broadcast / allgather / reducescatter (not allreduce)
mpi4py          the MPI library called directly through mpi4py, no wrapper
gloo            torch.distributed with the Gloo backend (when torch imports)
horovod         horovod.torch (when horovod imports; Horovod through TensorFlow, in
                its own venv, is peers/horovod_bench.py)
==============  ==============================================================

A runner that cannot exist here raises :class:`Unavailable` with the reason,
and the benchmark prints it as a '#' line: peers are skipped, never faked.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable

import numpy as np

__all__ = ["Unavailable", "Context", "make_runner", "OURS"]

#: Names that are our own allreduce algorithms (allreduce.algorithms.NAMES).
OURS = ("ring", "tree", "rhd", "rd", "mpi", "shm", "hierarchical", "auto")

_MPI_OPS = {"sum": "SUM", "avg": "SUM", "min": "MIN", "max": "MAX", "prod": "PROD"}


class Unavailable(Exception):
    """This peer or algorithm cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    """What a runner needs: our communicator, the mpi4py communicator, and the call."""

    comm: Any            # allreduce Communicator (check=False)
    mpi_comm: Any        # mpi4py communicator for peers (COMM_WORLD); None on the thread transport
    collective: str
    dtype: np.dtype
    op: str              # one of common.OP_NAMES

    @property
    def size(self) -> int:
        return self.comm.size


def make_runner(name: str, ctx: Context) -> Callable[[np.ndarray], np.ndarray]:
    """The runner for ``name``; raises ``Unavailable`` if it cannot run here."""
    if name in OURS:
        return _ours_allreduce(name, ctx)
    if name == "shm-reg":
        return _registered(ctx)
    if name == "ours":
        return _ours_other(ctx)
    if name == "mpi4py":
        return _mpi4py(ctx)
    if name == "gloo":
        return _gloo(ctx)
    if name == "horovod":
        return _horovod(ctx)
    raise ValueError(f"unknown algorithm or peer {name!r}; known: {', '.join(OURS)}, shm-reg, ours, mpi4py, "
                     "gloo, horovod")


def _as_op(op: str):
    from allreduce.ops import Op
    return {"sum": Op.SUM, "avg": Op.AVERAGE, "min": Op.MIN, "max": Op.MAX, "prod": Op.PRODUCT}[op]


def _ours_allreduce(name: str, ctx: Context):
    from allreduce import algorithms
    if ctx.collective != "allreduce":
        raise Unavailable(f"{name} is an allreduce algorithm; use 'ours' for {ctx.collective}")
    try:
        if name != "auto":                # auto: select.choose picks per call, from the cost model
            algorithms.get(name)
    except ImportError as exc:
        raise Unavailable(f"algorithm {name} not available in this tree ({exc})") from None
    comm, op = ctx.comm, _as_op(ctx.op)
    if name == "auto":
        return _auto_runner(comm, op)
    return lambda x: comm.allreduce_(x, op, algorithm=name)


def _registered(ctx: Context):
    """shm in place on a registered copy of each input: the first call on an input copies it into
    memory from ``shared_empty`` (collective: every rank meets its inputs in the same order), later
    calls reduce that memory where it lies. The result is the registered array."""
    if ctx.collective != "allreduce":
        raise Unavailable(f"shm-reg is an allreduce algorithm; use 'ours' for {ctx.collective}")
    if ctx.mpi_comm is None or ctx.size < 2:
        raise Unavailable("shm-reg needs MPI ranks that share a node")
    comm, op = ctx.comm, _as_op(ctx.op)
    copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}      # id(input) -> (input, registered copy)

    def run(x):
        held = copies.get(id(x))
        if held is None or held[0] is not x:
            reg = comm.shared_empty(x.shape, x.dtype)
            reg[...] = x
            copies[id(x)] = held = (x, reg)                       # x held: its id is not reused
        return comm.allreduce_(held[1], op, algorithm="shm")
    return run


def _auto_runner(comm, op):
    """``algorithm="auto"``; ``run.steady(nbytes)`` says whether auto has settled on its pick for
    that size (its run-time tuner times contenders on the first calls: warm-up runs until then)."""
    def run(x):
        return comm.allreduce_(x, op)
    run.steady = lambda nbytes: nbytes in comm.auto_picks
    return run


def _ours_other(ctx: Context):
    comm, op = ctx.comm, _as_op(ctx.op)
    if ctx.collective == "allreduce":
        return _auto_runner(comm, op)
    try:
        if ctx.collective == "broadcast":
            from allreduce.algorithms import broadcast  # noqa: F401
            return lambda x: comm.broadcast(x, 0)
        if ctx.collective == "allgather":
            return comm.allgather
        from allreduce.algorithms import reducescatter  # noqa: F401
        return lambda x: comm.reducescatter(x, op)
    except ImportError as exc:
        raise Unavailable(f"our {ctx.collective} is not available in this tree ({exc})") from None


def _mpi4py(ctx: Context):
    from mpi4py import MPI
    from allreduce import kernels
    half = ctx.dtype.itemsize == 2 and ctx.dtype.kind not in "iu"
    if half and ctx.collective in ("allreduce", "reducescatter"):
        raise Unavailable(f"mpi4py: MPI has no {ctx.dtype} type to reduce (algorithm 'mpi' covers it with a user op)")
    comm, p, op = ctx.mpi_comm, ctx.size, getattr(MPI, _MPI_OPS[ctx.op])
    bits = (lambda a: a.view(np.uint16)) if half else (lambda a: a)   # moving, not reducing: bytes will do
    avg = _as_op(ctx.op)

    def allreduce(x):
        comm.Allreduce(MPI.IN_PLACE, x, op=op)
        kernels.finish(x, avg, p)        # MPI has no average: sum, then divide (as Horovod does)
        return x

    def broadcast(x):
        comm.Bcast(bits(x), root=0)
        return x

    def allgather(x):
        out = np.empty(x.size * p, x.dtype)
        comm.Allgather(bits(x), bits(out))
        return out

    def reducescatter(x):
        out = np.empty(x.size // p, x.dtype)
        comm.Reduce_scatter_block(x, out, op=op)
        kernels.finish(out, avg, p)
        return out

    return {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather,
            "reducescatter": reducescatter}[ctx.collective]


_GLOO_READY = False


def _gloo_init(ctx: Context) -> None:
    """One Gloo process group per process: rank 0 picks a free port, MPI broadcasts it."""
    global _GLOO_READY
    import os
    import torch.distributed as dist
    if _GLOO_READY:
        return
    port = 0
    if ctx.mpi_comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = ctx.mpi_comm.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=ctx.mpi_comm.Get_rank(), world_size=ctx.size)
    _GLOO_READY = True
    # Stop Gloo's threads before the interpreter goes: torch 2.14's runLoop thread otherwise
    # touches Python objects during finalization and aborts the process (signal 6) at exit.
    import atexit
    atexit.register(dist.destroy_process_group)


def _torch_view(x: np.ndarray):
    import torch
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _gloo(ctx: Context):
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise Unavailable(f"gloo: torch is not importable ({exc}); pip install torch") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise Unavailable("gloo: this torch build has no Gloo backend")
    _gloo_init(ctx)
    p = ctx.size
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[ctx.op]
    integer = ctx.dtype.kind in "iu"

    def finish(t):
        # Gloo has no AVG (NCCL-only in torch): sum, then divide, like DDP's default hook.
        if ctx.op == "avg":
            if integer:
                t.copy_(torch.div(t, p, rounding_mode="trunc"))
            else:
                t.div_(p)

    def allreduce(x):
        t = _torch_view(x)
        dist.all_reduce(t, op=red)
        finish(t)
        return x

    def broadcast(x):
        dist.broadcast(_torch_view(x), src=0)
        return x

    def allgather(x):
        out = np.empty(x.size * p, x.dtype)
        dist.all_gather_into_tensor(_torch_view(out), _torch_view(x))
        return out

    def reducescatter(x):
        out = np.empty(x.size // p, x.dtype)
        t = _torch_view(out)
        dist.reduce_scatter_tensor(t, _torch_view(x), op=red)
        finish(t)
        return out

    run = {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather,
           "reducescatter": reducescatter}[ctx.collective]
    _probe("gloo", run, ctx)
    return run


def _horovod(ctx: Context):
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise Unavailable(f"horovod: horovod.torch is not importable ({exc}); horovod.tensorflow is timed "
                          "apart: benchmarks/peers/horovod_bench.py") from None
    hvd.init()
    if ctx.collective != "allreduce":
        raise Unavailable(f"horovod: only allreduce is benchmarked, not {ctx.collective}")
    red = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}[ctx.op]

    def allreduce(x):
        hvd.allreduce_(_torch_view(x), op=red, name="bench")
        return x

    _probe("horovod", allreduce, ctx)
    return allreduce


def _probe(name: str, run, ctx: Context) -> None:
    """One tiny call, so an unsupported dtype/op becomes a skip note instead of a crash mid-sweep.

    Backends reject unsupported dtypes locally, before any message, so every
    rank reaches the same verdict; the MPI vote below makes sure of it.
    """
    p = ctx.size
    reason = ""
    try:
        run(np.ones(2 if ctx.collective == "allgather" else 2 * p, ctx.dtype))
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    reasons = ctx.mpi_comm.allgather(reason)
    failed = [r for r in reasons if r]
    if failed:
        raise Unavailable(f"{name}: {ctx.collective} of {ctx.dtype} with op {ctx.op} not supported ({failed[0]})")
