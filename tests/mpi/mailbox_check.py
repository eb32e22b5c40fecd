"""Rank script: the MPI transport's shared-memory mailboxes (allreduce/transport/mailbox.py).

``mpirun -np P python mailbox_check.py [--expect-off]``.

* ``ar.init()`` on one node gives the direct path's and the engine's transports a mailbox (or,
  with ``--expect-off``, neither: ``ALLREDUCE_SHM_P2P=0`` or ``--mca btl tcp,self``).
* Thousands of exchanges between recursive-doubling pairs, each direction its own random size
  from 0 to twice the mailbox limit (so both channels, and mixed exchanges, where one direction
  rides the mailbox and the other MPI), random dtypes including bfloat16, interleaved with plain
  MPI sends on the same transport: every byte checked.
* A peer that does not take part: ``TransportTimeoutError`` naming it, after the timeout, not a hang.
"""
import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.errors import TransportTimeoutError
from allreduce.transport.mpi import MPITransport

world = MPI.COMM_WORLD
me, p = world.Get_rank(), world.Get_size()
comm = ar.init()
engine = ar.api._engine
if "--expect-off" in sys.argv:
    assert comm.transport.mailbox is None and engine.transport.mailbox is None, "mailbox on"
    ar.shutdown()
    if me == 0:
        print(f"OK mailbox_check on {p} ranks (off)")
    sys.exit(0)
assert comm.transport.mailbox is not None, "one node, yet no mailbox on the direct path"
assert getattr(engine.transport, "mailbox", None) is not None, "no mailbox on the engine's transport"
ar.shutdown()

t = MPITransport(mailbox=True, timeout=20.0)
box = t.mailbox
limit = box.limit
DTYPES = [np.uint8, np.int32, np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
rng = np.random.default_rng(1234)                      # the same stream on every rank


def payload(rank: int, step: int, nbytes: int, dtype) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    raw = ((np.arange(nbytes // itemsize * itemsize) * 7 + rank * 31 + step) % 251).astype(np.uint8)
    return raw.view(dtype)


steps = 3000 if p <= 2 else 1200
masks = [1 << k for k in range((p - 1).bit_length()) if (1 << k) < p]
sizes_seen = set()
for step in range(steps):
    mask = masks[step % len(masks)]
    choice = rng.integers(0, 10, size=p)                # per rank: what it sends this step
    raw_sizes = rng.integers(0, 2 * limit + 2, size=p)
    edge = [0, 1, limit - 1, limit, limit + 1, 2 * limit]
    sizes = [edge[c] if c < len(edge) else int(s) for c, s in zip(choice, raw_sizes)]
    dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
    item = np.dtype(dtype).itemsize
    peer = me ^ mask
    if peer >= p:
        continue
    mine = payload(me, step, sizes[me] // item * item, dtype)
    theirs = np.empty(sizes[peer] // item, dtype)
    t.exchange(mine, theirs, peer, tag=3)
    want = payload(peer, step, sizes[peer] // item * item, dtype)
    assert theirs.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), \
        f"rank {me} step {step}: wrong bytes from rank {peer} ({theirs.nbytes} B, {np.dtype(dtype).name})"
    sizes_seen.add((mine.nbytes <= limit, theirs.nbytes <= limit))
    if step % 97 == 0:                                  # plain MPI traffic between the same pair
        note = np.full(5, step + me, np.int64)
        got = np.empty(5, np.int64)
        req = t.irecv(got, peer, tag=9)
        t.send(note, peer, tag=9)
        req.wait()
        assert (got == step + peer).all(), f"rank {me}: MPI message beside the mailbox came wrong"
assert sizes_seen == {(True, True), (True, False), (False, True), (False, False)}, sizes_seen

# A peer that never takes part: rank 0 must time out naming rank 1, not hang.
lonely = MPITransport(mailbox=True, timeout=1.0)
if me == 0:
    try:
        lonely.exchange(np.zeros(4, np.float32), np.empty(4, np.float32), 1)
    except TransportTimeoutError as exc:
        assert "rank 1" in str(exc) and "mailbox" in str(exc), str(exc)
    else:
        raise AssertionError("an exchange with a silent peer returned")
world.Barrier()
lonely.close()
t.close()
if me == 0:
    print(f"OK mailbox_check on {p} ranks: {steps} exchanges up to {2 * limit} B, limit {limit} B")
