"""A rank whose training function raises leaves the elastic job; the reset limit ends it.

::

    rank 1: train(state) raises RuntimeError          ranks 0, 2, 3: inside a collective, or later
      traceback, one line naming the rank               |
      "allreduce-elastic: rank 1 raised ..."            |
      exit status 1, no MPI_Finalize  ---- a death -->  PeerLostError: restore, shrink, rebuild,
                                                        reset, sync, train again (recovery.py)

An exception on one rank (a bad record, a full disk, an out-of-memory on one
host) is the most common way a worker fails, so under ``allreduce-run
--elastic`` :func:`~allreduce.elastic.run` treats it as Horovod does: the rank
that raised ends, the others recover without it exactly as after a SIGKILL, and
the launcher names it with its exception's first line. If every rank raises
(the same bug everywhere), each ends the same way and the job ends non-zero:
there is nobody left to loop. Without ``--elastic`` the exception goes on up to
:mod:`allreduce.faults`, which aborts the whole job (fail fast).

Only an ``Exception`` leaves this way; ``SystemExit`` and ``KeyboardInterrupt``
go on up unchanged. The process exits with ``os._exit`` (no ``MPI_Finalize``,
no ``atexit``): its peers may be inside a collective with it, and a finalize
would wait for them. ``allreduce-run`` sets
``PRTE_MCA_state_base_error_non_zero_exit=0`` so that its status 1 does not make
Open MPI's runtime end the others (:mod:`.launch`).

The reset limit (Horovod's ``--reset-limit``; ``elastic_reset_limit``,
``ALLREDUCE_ELASTIC_RESET_LIMIT``): every shrink and every regrow is a reset.
When one more would exceed the limit, every rank says so and exits with status
``RESET_LIMIT_EXIT`` (5); ``--reset-limit 0`` allows none, ``1`` one. The ranks agree
on the count without a message: resets are collective, and a replacement is told
the count when it joins (:func:`.world.news`).
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from . import heartbeat, world
from .launch import RESET_LIMIT_EXIT, say

__all__ = ["leave", "check_reset_limit", "first_line", "LEAVE_EXIT"]

LEAVE_EXIT = 1          #: exit status of a rank that raised and left


def first_line(exc: BaseException) -> str:
    """``Type: the first line of the message`` (the whole message may be a page)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def leave(exc: BaseException) -> None:
    """Print the traceback and one line naming this rank, then end this process (never returns)."""
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    what = first_line(exc)
    who = world.who()                  # "rank 2 of 4 (name 3)", as every elastic line says it
    sys.stderr.write(f"allreduce: {who} failed with {what}; it leaves the elastic job, "
                     "and the other ranks go on without it\n")
    say(f"{who} raised {what}; it leaves the job")
    heartbeat.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LEAVE_EXIT)


def check_reset_limit(settings: dict[str, Any], state, what: str) -> None:
    """End the job on every rank if one more reset (``what``: a death, a regrow) would pass the limit."""
    limit = settings.get("elastic_reset_limit", -1)
    if limit < 0 or world.resets < limit:
        return
    say(f"reset limit {limit} reached: the world was reset {world.resets} time(s) and {what} would reset it "
        f"again (--reset-limit, ALLREDUCE_ELASTIC_RESET_LIMIT); the last commit was {state.describe()}; stopping")
    heartbeat.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(RESET_LIMIT_EXIT)      # as leave(): a peer may be dead, and the engine thread still waiting
