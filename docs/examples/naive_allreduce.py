"""The naive allreduce: everyone sends everything to rank 0, which adds and sends the sum back.

Written with the common signature of ``allreduce/algorithms/`` and explained
by the same tool as the real algorithms (``explain`` accepts a function)::

    python docs/examples/naive_allreduce.py 4 8      # ranks, elements
"""
import sys

from allreduce import kernels
from allreduce.explain import explain
from allreduce.explain.text import render

ROOT = 0


def naive_allreduce(comm, buf, op, *, workspace, segment_bytes):
    p, rank = comm.size, comm.rank
    if rank != ROOT:
        comm.mark("reduce", 0)
        comm.send(buf, ROOT)                          # my whole buffer to the root
        comm.mark("broadcast", 0)
        comm.recv(buf, ROOT)                          # the whole sum back
        return
    incoming = workspace.get("naive", buf.size, buf.dtype)
    comm.mark("reduce", 0)
    for peer in range(1, p):                          # p - 1 whole buffers, one after another
        comm.recv(incoming, peer)
        kernels.reduce_into(buf, incoming, op)
    comm.mark("broadcast", 0)
    for peer in range(1, p):                          # and p - 1 whole buffers out again
        comm.send(buf, peer)


if __name__ == "__main__":
    p, count = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 8)
    print(render(explain(naive_allreduce, p, count)), end="")
