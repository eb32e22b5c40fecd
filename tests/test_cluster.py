"""The namespace cluster (allreduce/cluster/): real multi-host launches, and nothing left behind.

One cluster per module (prefix ``arct``, so a user's ``arcl`` cluster is left alone): 2 hosts for
2 x 1 and 2 x 2 ranks, then 3 hosts for 3 x 1. Each launch runs tests/mpi/cluster_check.py, which
checks the placement, the cores and the yielding, then the core matrix (hierarchical and auto
included), the engine's any-order test and, at 2 hosts x 1 rank, tfops training equivalence.
Every launch runs under a timeout that kills mpirun and every process in the cluster's namespaces.
Where network namespaces are refused (not root), every test here skips, saying why.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from allreduce.cluster import cli, net

from .harness import MPI_SCRIPTS, TF_ENV, mpi_env

PREFIX = "arct"
TIMEOUT = 300
RUN = Path(sys.executable).parent / "allreduce-run"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(2 * TIMEOUT)]


def _refused() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root; the cluster tests run as root (CI does)"
    try:
        net.check_permitted(PREFIX)
    except Exception as exc:       # noqa: BLE001 - any refusal means: skip, saying why
        return str(exc)
    return ""


@pytest.fixture(scope="module")
def cluster():
    """Bring up the test cluster at ``n`` hosts (reusing it while n is unchanged); always taken down."""
    why = _refused()
    if why:
        pytest.skip(why)

    def at(nodes: int) -> net.Cluster:
        return cli.up(nodes=nodes, link="10gbit", slots=2, prefix=PREFIX, seconds=0.2)
    try:
        yield at
    finally:
        net.down(PREFIX)


def launch(np_: int, *args: str, timeout: float = TIMEOUT) -> str:
    """``allreduce-run --cluster=arct -np np_ python cluster_check.py args``; stdout. Fails on error or timeout."""
    cmd = [str(RUN), f"--cluster={PREFIX}", "-np", str(np_), sys.executable, str(MPI_SCRIPTS / "cluster_check.py"),
           *args]
    env = {**mpi_env(), **TF_ENV}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for space in net.existing(PREFIX)[0]:       # the ranks: every process inside the cluster's hosts
            net.kill_inside(space)
        out, err = proc.communicate()
        pytest.fail(f"TIMEOUT after {timeout:g} s: {' '.join(cmd[1:])}\n{out[-3000:]}\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[1:])} exited {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}")
    return out


def test_up_makes_hosts_links_and_files_and_is_idempotent(cluster):
    c = cluster(2)
    spaces, links = net.existing(PREFIX)
    assert sorted(spaces) == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
    assert {f"{PREFIX}-br", f"{PREFIX}-h0", f"{PREFIX}-h1"} <= set(links)
    d = net.state_dir(PREFIX)
    assert (d / "agent").exists() and (d / "hostfile").read_text().count("slots=2") == 2
    qdisc = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-h1", "tc", "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout
    assert "tbf" in qdisc and "10Gbit" in qdisc, qdisc
    assert c.measured.get("stream_gbit_s", 0) > 0, c.measured          # the probe crossed the link
    assert [h.cores for h in c.hosts] == net.cores_for(2)
    assert cluster(2) == c                                              # same arguments: kept as it is


@pytest.mark.parametrize("np_, tf", [(2, True), (4, False)], ids=["2x1", "2x2"])
def test_two_hosts(cluster, np_, tf):
    cluster(2)
    out = launch(np_, "2", *(["--tf"] if tf else []))
    for r in range(np_):
        assert f"rank {r}: cluster placement OK (2 hosts x {np_ // 2}" in out, out[-3000:]
        assert f"rank {r}: cluster_check OK" in out, out[-3000:]
    assert f"on {np_} ranks: ring,mpi,hierarchical,auto" in out and "engine_stress" in out, out[-3000:]
    if tf:
        assert all(f"rank {r}: tf_train OK" in out for r in range(np_)), out[-3000:]


def test_three_hosts_one_rank_each(cluster):
    cluster(3)
    assert len(net.existing(PREFIX)[0]) == 3                          # up with other arguments: replaced
    out = launch(3, "3")                 # tf_train.py needs an even world size (its batch of 64)
    for r in range(3):
        assert f"rank {r}: cluster placement OK (3 hosts x 1" in out and f"rank {r}: cluster_check OK" in out, \
            out[-3000:]


def test_down_leaves_nothing_even_after_a_half_made_up(cluster):
    cluster(2)
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-h7"], check=True)     # what a crashed `up` could leave
    subprocess.run(["ip", "link", "add", f"{PREFIX}-h7", "type", "veth", "peer", "name", f"{PREFIX}-h7-p"],
                   check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-h1", "sleep", "300"])
    assert cli.main(["--prefix", PREFIX, "down"]) == 0
    assert sleeper.wait(timeout=10) != 0                                  # the process inside was stopped
    assert net.existing(PREFIX) == ([], [])
    assert not net.state_dir(PREFIX).exists()
    assert cli.main(["--prefix", PREFIX, "status"]) == 3


def test_refused_namespaces_say_so_in_one_line():
    if os.geteuid() != 0 or subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode:
        pytest.skip("needs root and user namespaces to run without the privileges")
    # In a new user namespace this process has no CAP_SYS_ADMIN over the machine's network namespaces.
    proc = subprocess.run(["unshare", "--user", str(RUN.with_name("allreduce-cluster")), "--prefix", "arcz",
                           "up", "--nodes", "2"], capture_output=True, text=True, timeout=60, env=mpi_env())
    assert proc.returncode == 1, proc
    assert proc.stderr.count("\n") == 1 and "not permitted" in proc.stderr, proc.stderr


def test_report_section_says_why_it_skips(monkeypatch):
    """benchmarks/report.py's cluster section, where namespaces are refused: one line, before making anything."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import cluster_section
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    text, data = cluster_section.run({}, timeout=10)
    assert data is None and text.count("\n") == 0 and "needs root" in text, text
