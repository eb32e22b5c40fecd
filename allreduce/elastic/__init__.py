"""Elastic training: a rank dies, the survivors shrink, restore the last commit and go on.

Horovod's elastic API on plain MPI (Open MPI's ULFM), started with
``allreduce-run --elastic -np N [--min-np M] [--max-np K] python train.py``::

    import allreduce as ar
    from allreduce import elastic

    ar.init()
    state = elastic.ObjectState(epoch=0, step=0, w=np.zeros(10))

    @elastic.run
    def train(state):
        while state.step < 100:
            grad = ar.allreduce(compute_gradient(state.w, ar.rank(), ar.size()))
            state.w -= 0.1 * grad
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

* :mod:`.state`: :class:`State`, :class:`ObjectState` (commit, restore, sync,
  reset callbacks).
* :mod:`.recovery`: :func:`run` (restore, revoke + shrink, rebuild, reset, sync,
  call again).
* :mod:`.regrow`: below ``--max-np``, a commit raises ``HostsUpdatedInterrupt``
  and :func:`run` spawns replacements that get the state by ``sync``.
* :mod:`.failure`: a rank whose training function raises leaves the job (the
  others recover as after a death); ``--reset-limit`` ends the job.
* :mod:`.heartbeat`: a rank that is alive but silent (stopped, hung) stops
  beating; the others name it, and the launcher evicts it (:mod:`.evict`: SIGKILL
  by pid); then it is a death like any other.
* :mod:`.partition`: the heartbeat across hosts (UDP), and the majority rule
  when a host's link is cut: the side with the majority goes on, the other stops.
* :mod:`.world`: who is in the world as it shrinks and grows (names, sizes).
* :mod:`.launch`: what ``allreduce-run --elastic`` adds to the mpirun command and
  how it summarises the job.

Detection of a dead peer is the transport's: :mod:`allreduce.transport.liveness`.
See docs/11-when-a-rank-dies.md.
"""
from ..errors import HostsUpdatedInterrupt
from .state import ObjectState, State

__all__ = ["run", "State", "ObjectState", "HostsUpdatedInterrupt"]


def __getattr__(name: str):
    # run is loaded on first use: it starts MPI, which allreduce-run (importing .launch) must not
    if name == "run":
        from .recovery import run
        return run
    raise AttributeError(f"module 'allreduce.elastic' has no attribute {name!r}")
