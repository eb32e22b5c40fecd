"""An elastic training loop that kills its own ranks on cue (tests/test_elastic.py).

Run under ``allreduce-run --elastic``::

    ELASTIC_KILLS="3@5:ring,0@9:engine" allreduce-run --elastic -np 4 python tests/mpi/elastic_train.py

``ELASTIC_KILLS`` lists ``name@step:phase``: that process (its rank in the
starting world, or a replacement's number: ``allreduce.elastic.world``)
SIGKILLs itself at that step, in that phase:

* ``compute``: while computing its gradient;
* ``ring``, ``tree``, ``rhd``, ``rd``, ``mpi``, ``shm``, ``mailbox``: inside a direct
  allreduce with that algorithm (a timer thread fires 0-3 ms into the call;
  ``mailbox`` is ``rd`` on a message small enough for the shared-memory boxes);
* ``engine``: inside a named allreduce (negotiation, fusion, the engine's wait);
* ``commit``: half-way through ``state.commit()``;
* ``sync``: inside ``state.sync()``: step ``-1`` the first one after a recovery
  (shrink), step ``-2`` the first one after a regrow (where the replacements get
  the state; a replacement named here dies in its very first sync).
* ``hang``: stops itself with SIGSTOP while computing its gradient, for good:
  alive but silent (allreduce/elastic/heartbeat.py evicts it);
* ``deadlock``: sleeps for good in its training loop, its heartbeat thread still running (a
  deadlock in user code with the GIL free): its peers' waits time out and blame it;
* ``stall``: sleeps for good between the direct allreduce and the named one: its engine
  thread goes on, the others' named allreduce fails with ``StallError`` and blames it;
* ``slow``: stops itself with SIGSTOP and a helper process sends SIGCONT
  ``ELASTIC_SLOW_SECONDS`` (2) later: slow, not hung (it must not be evicted);
* ``spawn``: 0.2 s after the commit at that step, while the parents wait in
  ``MPI_Comm_spawn`` for a replacement (only at a commit that regrows).

``ELASTIC_RAISES`` lists ``name@step:phase`` the same way: that process raises
``RuntimeError`` (allreduce/elastic/failure.py: it leaves the job, the others
recover as after a death), in one of three phases:

* ``compute``: while computing its gradient;
* ``collective``: between two collectives, while its peers wait in the engine's;
* ``commit``: half-way through ``state.commit()``.

``ELASTIC_RESET_RAISES`` lists ``name@n``: that process raises ``RuntimeError``
inside its n-th reset callback (1: the first recovery it lives through).
Rank 0 prints ``RESUMED <size> <time>`` when the first step after each reset
is done (tests/test_elastic_hang.py times hang -> first step after the eviction).

``ELASTIC_STOP_IN=<name>:<step>:<n>``: that process stops itself (SIGSTOP, for good) as it
enters that recovery step (``MPI_Comm_shrink``) for the n-th time: a hang in the middle of
a recovery (the others evict it there).

``ELASTIC_JOIN_DIE=<path>``: the first replacement (the one that finds no file
at ``path`` and makes it) SIGKILLs itself before it merges with its parents.
``ELASTIC_STUCK=<name>:<step>``: that process blocks forever inside MPI (a
receive nobody sends) when it enters that recovery step (``MPI_Comm_shrink``;
:mod:`allreduce.elastic.watchdog`), as Open MPI's ULFM deadlock would.

``ELASTIC_STEP_SLEEP=<seconds>``: every rank sleeps that long after each step, and rank 0
prints ``STEP <steps done> <size> <time>`` first (tests/test_cluster.py cuts a host's link
at a step it reads there).

Under ``--max-np`` the world grows back at the commit after a death
(:mod:`allreduce.elastic.regrow`): replacements run this script too, named
4, 5, ... (``allreduce.elastic.world``), and can be killed like any other.

The model: SGD with momentum on ``w`` (64 float64), ``steps`` steps, a commit
every ``ELASTIC_COMMIT_EVERY`` steps. Rank r of n at step s contributes the
gradient ``grad(w, s, r, n)``: integer-valued, so every algorithm's sum is exact
and the result is the same bits whatever the order of the additions. The
state records the world size of every step it took (``sizes``), so the test
replays the committed lineage in numpy and compares bitwise. Each survivor
prints ``FINAL <world rank> <size> <hex of w and v> <sizes> resets=[...] keys=...`` at the end.
The state also carries user keywords named as the library's own bookkeeping
used to be (``commits``, ``in_run``, ``rendezvous``: Horovod's worker counts its
commits and its entries into ``train``), which must come out as the user left them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np

import allreduce as ar
from allreduce import elastic
from allreduce.elastic import watchdog, world
from allreduce.transport.mpi import MPI

N, LR, MU = 64, 2.0 ** -6, 0.5
ALGORITHMS = ("ring", "tree", "rhd", "rd", "mpi", "shm", "auto")
#: the algorithms the steps cycle through (ELASTIC_ALGORITHMS: across hosts, leave out shm)
CYCLE = tuple(os.environ.get("ELASTIC_ALGORITHMS", ",".join(ALGORITHMS)).split(","))


def grad(w: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    """The gradient of rank ``rank`` of ``size`` at ``step``: small integers, so sums are exact."""
    base = (np.arange(N) * (step + 1) + 7 * rank + size) % 11 - 5.0
    return base + np.floor(w * 4.0) % 3


def sgd(w, v, g_sum, size):
    v = MU * v + g_sum / size
    return w - LR * v, v


def replay(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The committed lineage in numpy: step s ran on sizes[s] ranks."""
    w, v = np.zeros(N), np.zeros(N)
    for step, size in enumerate(sizes):
        g = sum(grad(w, step, r, size) for r in range(size))
        w, v = sgd(w, v, g, size)
    return w, v


def _kills(variable: str = "ELASTIC_KILLS") -> dict[tuple[int, int], str]:
    out = {}
    for item in filter(None, os.environ.get(variable, "").split(",")):
        who, rest = item.split("@")
        step, phase = rest.split(":")
        out[(int(who), int(step))] = phase
    return out


KILLS = _kills()
RAISES = _kills("ELASTIC_RAISES")
ME = -1          # this process's name (elastic.world.name()), known after ar.init()


def die_soon(delay: float) -> None:
    """SIGKILL this process ``delay`` seconds from now, from a timer thread (mid-call)."""
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()


def maybe_die(step: int, phase: str, *, mid_call: bool = True) -> None:
    if KILLS.get((ME, step)) == phase:
        print(f"KILL {ME} step {step} {phase} at {time.time():.6f}", flush=True)
        if mid_call:
            die_soon(np.random.default_rng(abs(step) + 1).uniform(0, 0.003))
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def maybe_stop(step: int) -> None:
    """``hang``: SIGSTOP for good; ``slow``: SIGSTOP, and SIGCONT from a helper a few seconds later."""
    phase = KILLS.get((ME, step))
    if phase == "deadlock":
        print(f"DEADLOCK {ME} step {step} at {time.time():.6f}", flush=True)
        time.sleep(150)                  # bounded: if nobody evicts it, the test fails instead of hanging
    if phase not in ("hang", "slow"):
        return
    print(f"{phase.upper()} {ME} step {step} at {time.time():.6f}", flush=True)
    if phase == "slow":
        pause = float(os.environ.get("ELASTIC_SLOW_SECONDS", "2"))
        subprocess.Popen(["sh", "-c", f"sleep {pause}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    print(f"CONTINUED {ME} step {step} at {time.time():.6f}", flush=True)


def maybe_raise(step: int, phase: str) -> None:
    if RAISES.get((ME, step)) == phase:
        print(f"RAISE {ME} step {step} {phase} at {time.time():.6f}", flush=True)
        raise RuntimeError(f"check_rank and exit: name {ME} at step {step} in {phase}\nsecond line")


class TrainState(elastic.ObjectState):
    def save(self):
        if RAISES.get((ME, self.step)) == "commit":    # half the attributes copied, then the raise
            self._saved_state["w"] = self.w.copy()
            maybe_raise(self.step, "commit")
        if KILLS.get((ME, self.step)) == "spawn":      # the parents spawn right after this commit
            print(f"KILL {ME} step {self.step} spawn at {time.time():.6f}", flush=True)
            die_soon(0.2)
        if KILLS.get((ME, self.step)) == "commit":     # half the attributes copied, then death
            self._saved_state["w"] = self.w.copy()
            maybe_die(self.step, "commit", mid_call=False)
        super().save()

    def sync(self):
        if KILLS.get((ME, -1)) == "sync" and world.deaths:
            maybe_die(-1, "sync")
        if KILLS.get((ME, -2)) == "sync" and (world.joins or ME >= world.start_size()):   # a replacement:
            # its first sync (the job's first regrow is not yet in world.joins when it joins)
            maybe_die(-2, "sync")
        super().sync()


def _join_or_die() -> None:
    path = os.environ.get("ELASTIC_JOIN_DIE")
    if path and MPI.Comm.Get_parent() != MPI.COMM_NULL:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return                                       # a later replacement: it joins
        print(f"KILL join before merge at {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_entered: dict[str, int] = {}


def _stuck_in(step: str) -> None:
    """Block this process inside MPI when it enters ``step`` (ELASTIC_STUCK); stop it (SIGSTOP, for
    good) when it enters ``step`` for the n-th time (ELASTIC_STOP_IN=name:step:n)."""
    _entered[step] = _entered.get(step, 0) + 1
    who, _, rest = os.environ.get("ELASTIC_STOP_IN", "::").partition(":")
    what, _, nth = rest.rpartition(":")
    if who and int(who) == ME and step == what and _entered[step] == int(nth):
        print(f"HANG {ME} in {step} at {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    name, _, what = os.environ.get("ELASTIC_STUCK", ":").partition(":")
    if name and int(name) == ME and step == what:
        print(f"STUCK {ME} in {step} at {time.time():.6f}", flush=True)
        MPI.COMM_SELF.Dup().Recv(bytearray(1), source=0, tag=99)     # nobody sends it


def main() -> None:
    global ME
    _join_or_die()
    ar.init()
    ME = world.name()
    watchdog.test_hook = _stuck_in
    steps = int(os.environ.get("ELASTIC_STEPS", "24"))
    every = int(os.environ.get("ELASTIC_COMMIT_EVERY", "3"))
    pace = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    state = TrainState(w=np.zeros(N), v=np.zeros(N), step=0, sizes=[], commits=0, in_run=f"r{ME}", rendezvous=0)
    resets = []
    resumed = [False]
    raise_at = {int(n) for w, _, n in (item.partition("@") for item in
                os.environ.get("ELASTIC_RESET_RAISES", "").split(",") if item) if int(w) == ME}

    def on_reset():
        resets.append(ar.size())
        resumed[0] = True
        if len(resets) in raise_at:
            print(f"RAISE {ME} reset {len(resets)} at {time.time():.6f}", flush=True)
            raise RuntimeError(f"reset callback raised on name {ME} at reset {len(resets)}")
    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        state.rendezvous += 1
        while state.step < steps:
            s, rank, size = state.step, ar.rank(), ar.size()
            maybe_die(s, "compute", mid_call=False)
            maybe_raise(s, "compute")
            maybe_stop(s)
            g = grad(state.w, s, rank, size)
            phase = next((p for (_, at), p in KILLS.items() if at == s), "")   # the same on every rank
            algo = phase if phase in ALGORITHMS else ("rd" if phase == "mailbox" else CYCLE[s % len(CYCLE)])
            big = np.tile(g, 1024 if phase not in ("rd", "mailbox") else 1)   # 512 KiB: the kill lands mid-call
            if phase in ALGORITHMS or phase == "mailbox":
                maybe_die(s, phase)
            for _ in range(3 if phase else 1):
                total = ar.allreduce(big, op=ar.Sum, algorithm=algo)
            maybe_die(s, "engine")
            maybe_raise(s, "collective")
            if KILLS.get((ME, s)) == "stall":
                print(f"STALL {ME} step {s} at {time.time():.6f}", flush=True)
                time.sleep(150)
            twice = ar.allreduce(g, op=ar.Sum, name=f"g{s % 4}")     # the engine: negotiated, fused
            if not np.array_equal(total[:N], twice):
                raise AssertionError(f"step {s}: direct and engine sums differ")
            state.w, state.v = sgd(state.w, state.v, total[:N], size)
            state.sizes = state.sizes + [size]
            state.step = s + 1
            if resumed[0] and rank == 0:
                print(f"RESUMED {size} {time.time():.6f}", flush=True)
            resumed[0] = False
            if pace:                     # ELASTIC_STEP_SLEEP: a job slow enough to cut a link in (test_cluster)
                if rank == 0:
                    print(f"STEP {state.step} {size} {time.time():.6f}", flush=True)
                time.sleep(pace)
            if state.step % every == 0:
                state.commits += 1
                state.commit()

    train(state)
    print(f"FINAL {ME} {ar.size()} {state.w.tobytes().hex()} {state.v.tobytes().hex()} "
          f"{','.join(map(str, state.sizes))} resets={resets} keys=commits:{state.commits},in_run:{state.in_run},"
          f"rendezvous:{state.rendezvous}", flush=True)
    ar.shutdown()


if __name__ == "__main__":
    main()
