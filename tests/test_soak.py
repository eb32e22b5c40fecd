"""Soak: 10^5 random named allreduces through the engine on 3 ranks, each checked; memory flat.

The rank script is tests/mpi/soak.py (its docstring says what is random and
how each result is checked). The longer soak is the same script with more
operations; RELIABILITY.md holds its command and recorded output.
"""
import re

import pytest

from .harness import mpirun


@pytest.mark.mpi
def test_soak_100k_engine_ops_3_ranks_checked_and_memory_flat():
    out = mpirun(3, "soak.py", "--ops", "100000", "--rss-bound-mib", "20", timeout=420).stdout
    oks = re.findall(r"OK soak rank \d: (\d+) ops checked, VmRSS growth ([\d.]+) MiB", out)
    assert len(oks) == 3, out[-3000:]
    assert all(int(n) >= 100_000 and float(growth) <= 20 for n, growth in oks), oks
