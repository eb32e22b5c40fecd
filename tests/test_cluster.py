"""The namespace cluster (allreduce/cluster/): real multi-host launches, and nothing left behind.

One cluster per module (prefix ``arct``, so a user's ``arcl`` cluster is left alone): 2 hosts for
2 x 1 and 2 x 2 ranks, then 3 hosts for 3 x 1. Each launch runs tests/mpi/cluster_check.py, which
checks the placement, the cores and the yielding, then the core matrix (hierarchical and auto
included), the engine's any-order test and, at 2 hosts x 1 rank, tfops training equivalence.
Every launch runs under a timeout that kills mpirun and every process in the cluster's namespaces.
Where network namespaces are refused (not root), every test here skips, saying why.
"""
import os
import re
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


CUT_PREFIX = "hb"          # its own cluster: the link it cuts is no other test's
CUT_BOUND = 4.0            # ALLREDUCE_ELASTIC_HANG_TIMEOUT: silence before a host counts as cut off
CUT_SLACK = 6.0            # cut -> the survivors' recovery line, beyond the bound


def _python_in(space: str) -> list[int]:
    """Pids of the python processes (ranks) inside namespace ``space``."""
    out = subprocess.run(["ip", "netns", "pids", space], capture_output=True, text=True).stdout.split()
    found = []
    for pid in out:
        try:
            if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_cut_link_the_side_with_rank_0_goes_on_and_the_other_stops():
    """-np 4 over 2 hosts x 2, --elastic --min-np 2 --max-np 4: host 1's link goes down for 1.5 s at step 3
    (under the bound: nobody is evicted), then for good at step 8.
    Host 0 (ranks 0, 1: half, with rank 0) names 2 and 3 unreachable, leaves them out and finishes
    at 2 of 4 without regrowing, bitwise equal to the replay; host 1's ranks stop themselves.
    Bounded: cut -> recovery line within CUT_BOUND + CUT_SLACK; the whole launch within TIMEOUT."""
    why = _refused()
    if why:
        pytest.skip(why)
    import threading
    import time

    from benchmarks import elastic_chaos
    net.down(CUT_PREFIX)
    try:
        cluster = cli.up(nodes=2, link="none", slots=2, prefix=CUT_PREFIX, seconds=0.1)
        env = {**mpi_env(), "ELASTIC_STEPS": "18", "ELASTIC_STEP_SLEEP": "0.3", "ELASTIC_COMMIT_EVERY": "3",
               "ELASTIC_ALGORITHMS": "ring,tree,rhd,rd,mpi,auto",
               "ALLREDUCE_ELASTIC_HANG_TIMEOUT": f"{CUT_BOUND:g}", "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": "30"}
        cmd = [str(RUN), f"--cluster={CUT_PREFIX}", "--elastic", "-np", "4", "--min-np", "2", "--max-np", "4",
               sys.executable, str(MPI_SCRIPTS / "elastic_train.py")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        out, err, cut = [], [], {}

        def link(state: str) -> None:
            subprocess.run(["ip", "link", "set", cluster.hosts[1].name, state], check=True)

        def read_out():
            for line in proc.stdout:
                out.append(line)
                if line.startswith("STEP 3 ") and "flap" not in cut:      # down for 1.5 s: under the bound
                    cut["flap"] = time.time()
                    link("down")
                    threading.Timer(1.5, link, ("up",)).start()
                if line.startswith("STEP 8 ") and "at" not in cut:
                    link("down")
                    cut["at"] = time.time()

        def read_err():
            for line in proc.stderr:
                err.append(line)
                if "mpirun still waits" in line:
                    cut["mpirun ended"] = time.time()

        def watch_host_1():       # when host 1's ranks are gone (before the launcher ends mpirun)
            while proc.poll() is None and "ranks gone" not in cut:
                if "at" in cut and not _python_in(cluster.hosts[1].name):
                    cut["ranks gone"] = time.time()
                time.sleep(0.2)
        threads = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err, watch_host_1)]
        for t in threads:
            t.start()
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"TIMEOUT after {TIMEOUT} s: the cut-link launch\n{''.join(out)[-3000:]}\n{''.join(err)[-4000:]}")
        finally:
            for t in threads:
                t.join(10)
        stdout, stderr = "".join(out), "".join(err)
        text = f"{stdout[-3000:]}\n{stderr[-5000:]}"
        assert "at" in cut, text
        assert proc.returncode == 0, text
        summary = [line for line in stderr.splitlines() if line.startswith("allreduce-run: elastic job")][-1]
        assert summary.startswith("allreduce-run: elastic job finished with 2 of 4 ranks"), summary
        for name in (2, 3):
            assert re.search(rf"evicted rank {name} of 4 \(name {name}, pid \d+ on \S+\) left out, not killed \(the "
                             r"other side of the cut stops itself\): unreachable: nothing heard from host \S+ for "
                             r"[\d.]+ s", summary), summary
        noticed = re.search(r"rank 2 of 4 \(name 2\), rank 3 of 4 \(name 3\) died \(noticed at ([\d:.]+) UTC, "
                            r"unreachable", stderr)
        assert "rank 2 of 4 (name 2), rank 3 of 4 (name 3) left out (unreachable) at" in summary, summary
        assert noticed, text
        h, m, s = noticed.group(1).split(":")
        waited = (int(h) * 3600 + int(m) * 60 + float(s) - cut["at"] % 86400) % 86400
        gone = cut.get("ranks gone", float("inf")) - cut["at"]
        print(f"a 1.5 s flap at step 3 (kept), cut at step 8; recovery line {waited:.2f} s later, host 1's ranks gone {gone:.2f} s later "
              f"(bound {CUT_BOUND:g} s)")
        print("\n".join(line for line in stderr.splitlines() if line.startswith("allreduce-run:")))
        # the last beat before the cut came up to a beat (0.25 s) before it: the bound counts from there
        assert CUT_BOUND - 0.5 <= waited <= CUT_BOUND + CUT_SLACK, (waited, text)
        # they stopped themselves: gone within the bound, before anything ended mpirun
        assert CUT_BOUND - 0.5 <= gone <= CUT_BOUND + CUT_SLACK and cut["ranks gone"] < cut.get("mpirun ended", 1e18), cut
        assert "joined" not in summary, summary                          # below --max-np: no regrow
        assert len(re.findall(r"evicted rank", summary)) == 2 and stderr.count("going on with") == 1, summary
        finals = re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=", stdout, re.M)
        assert sorted(f[0] for f in finals) == ["0", "1"] and len({f[1:] for f in finals}) == 1, text
        w, v = elastic_chaos.replay([int(n) for n in finals[0][4].split(",")])
        assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4], "state differs from the replay"
        assert _python_in(cluster.hosts[1].name) == [], "host 1's ranks did not stop themselves"
        subprocess.run(["ip", "link", "set", cluster.hosts[1].name, "up"], check=True)     # the link comes back
        time.sleep(1)
        assert _python_in(cluster.hosts[1].name) == []                   # nothing of the other side rejoins
    finally:
        net.down(CUT_PREFIX)
    assert net.existing(CUT_PREFIX) == ([], [])
