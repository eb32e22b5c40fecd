"""The three np = 1..5 MPI matrices in one job, so each world size pays one start-up, not three.

    mpirun -np N python matrix_check.py

runs, one after the other in this process (each with its own ``ar.init()`` / ``ar.shutdown()``
or its own communicator): api_check.py ring,mpi; tree_rd_check.py tree,rd 512; collectives_check.py.
Each prints its own OK line; a failure raises out of this script (and the faults hook aborts the job).
"""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent
JOBS = [("api_check.py", ["ring,mpi"]), ("tree_rd_check.py", ["tree,rd", "512"]), ("collectives_check.py", [])]

for script, args in JOBS:
    sys.argv = [str(HERE / script), *args]
    runpy.run_path(str(HERE / script), run_name="__main__")
    sys.stdout.flush()
