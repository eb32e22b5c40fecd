"""Registered buffers on 3 thread ranks: shm reduces them where they lie (docs/10-shared-memory.md).

    python docs/examples/registered_buffers.py

Every rank allocates with ``shared_empty`` (collective), writes its input into it, and reduces
it in place with algorithm ``shm``: the peers read it directly, so nothing is copied into a
shared segment first. The same inputs through a private array (shm's copy-in path) give the same
bits. Then rank 1 passes another slice than its peers, and every rank raises.
"""
import numpy as np

from allreduce import Communicator, Config, MismatchError, Sum
from allreduce.transport import shared
from allreduce.transport.threads import run_threads

P, N = 3, 8


def body(t):
    comm = Communicator(t, config=Config(check=False, algorithm="shm"))
    x = np.arange(N, dtype=np.float32) * (t.rank + 1) + 0.1      # rank r: 0.1, r+1.1, 2r+2.1, ...
    buf = comm.shared_empty(N, np.float32)
    buf[:] = x
    registered = shared.find(t, buf) is not None
    comm.allreduce_(buf, Sum)                   # in place, where it lies
    private = comm.allreduce_(x.copy(), Sum)    # the copy-in path, on a private array
    start = 1 if t.rank == 1 else 0
    try:
        comm.allreduce_(buf[start:start + 4], Sum)
        error = "no error"
    except MismatchError as exc:
        error = str(exc)
    return registered, buf.copy(), buf.tobytes() == private.tobytes(), error


results = run_threads(P, body)
print(f"{P} thread ranks, {N} float32 elements each, op Sum (rank r holds (r + 1) * arange({N}) + 0.1)")
for rank, (registered, out, same, _) in enumerate(results):
    print(f"rank {rank}: registered {registered}, result {np.array2string(out, precision=1)}, "
          f"same bits as the copy-in path: {same}")
print("then rank 1 passes buf[1:5] and the others buf[0:4]:")
for rank, (*_, error) in enumerate(results):
    print(f"  {error}")
