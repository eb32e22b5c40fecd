"""Rank script: auto on a registered array (``shared_empty``) of 64 KiB or more is tuned apart
from a private array of the same size (tests/test_autotune.py); a smaller one shares its pick.

``mpirun -np P python autotune_registered.py``. One registered and one private array of each size
are reduced in place under ``auto``, interleaved, until the tuner has kept a pick for both; every
result is checked exactly (small integers), the last of each bitwise across ranks. Then: the books
hold ``size`` for the private array and ``~size`` for the registered one (only ``size`` for both
below ``auto.REGISTERED_MIN_BYTES``), every rank kept the same
picks and scores, shm ran in place on the registered array whenever auto ran shm there, and the
private array never took that path.
"""
import numpy as np

import allreduce as ar
from allreduce import auto, autotune
from allreduce.transport.mpi import MPI
from allreduce.algorithms import shm
from allreduce.transport import shared

world = MPI.COMM_WORLD
ar.init(check=False)
p, me = ar.size(), ar.rank()
comm = ar.communicator()
assert comm.tuner is not None
autotune.GAP_SECONDS = 0.01     # the recheck's gap, shortened: the same steps in a test's time
TRIES = 4 * autotune.MAX_GAP    # calls before a size must be decided (both timings and the gap)

in_place = []                   # the size of every array shm.zero_copy reduced in place
real_zero_copy = shm.zero_copy


def spy(comm_, seg, buf, offset, op, slot_bytes=None):
    in_place.append(buf.size)
    return real_zero_copy(comm_, seg, buf, offset, op, slot_bytes)


shm.zero_copy = spy
SIZES = [1000, 1 << 20]                                      # float32 elements: 4 KB and 4 MiB
last = {}
for n in SIZES:
    reg = ar.shared_empty(n, np.float32)
    assert shared.find(comm.transport, reg) is not None
    private = np.empty(n, np.float32)
    want = (p * (np.arange(n) % 7) + p * (p - 1) / 2).astype(np.float32)
    for _ in range(TRIES):
        for name, x in (("registered", reg), ("private", private)):
            x[:] = np.arange(n) % 7 + me                       # small integers: every order is exact
            ar.allreduce_(x, op=ar.Sum)
            assert np.array_equal(x, want), f"rank {me}: wrong sum on the {name} array of {n} elements"
        if n * 4 in comm.auto_picks and (~(n * 4) in comm.auto_picks or n * 4 < auto.REGISTERED_MIN_BYTES):
            break
    last[n] = (reg.copy(), private.copy())
    before = len(in_place)                                   # five more calls of each, tuned
    for _ in range(5):
        ar.allreduce_(reg, op=ar.Sum)
    if comm.auto_picks.get(~(n * 4), comm.auto_picks[n * 4]) == "shm":
        assert in_place[before:] == [n] * 5, f"auto ran shm on the registered array, not in place: {in_place[before:]}"
    else:
        assert len(in_place) == before
    before = len(in_place)
    for _ in range(5):
        ar.allreduce_(private, op=ar.Sum)
    assert len(in_place) == before, "a private array was reduced as if registered"
for n, (a, b) in last.items():
    for got in (a, b):
        blobs = world.allgather(got.tobytes())
        assert all(blob == blobs[0] for blob in blobs), f"{n} elements: results differ bitwise across ranks"
picks = world.allgather(dict(comm.auto_picks))
assert all(book == picks[0] for book in picks), f"auto picked differently across ranks: {picks}"
for n in SIZES:
    apart = n * 4 >= auto.REGISTERED_MIN_BYTES
    assert n * 4 in picks[0] and (~(n * 4) in picks[0]) == apart, (n, picks[0])
books = world.allgather(comm.tuner.decided)
assert all(book == books[0] for book in books), f"ranks scored differently: {books}"


def label(key):
    return f"~{~key}" if key < 0 else str(key)


if me == 0:
    shown = {label(k): v for k, v in picks[0].items()}
    scores = {label(k): {a: round(t * 1e6) for a, t in v.items()} for k, v in books[0].items()}
    print(f"OK autotune_registered on {p} ranks: picks {shown}, scores (us) {scores}, "
          f"{len(in_place)} calls reduced in place")
ar.shutdown()
