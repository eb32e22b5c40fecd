"""Launching one MPI job across the cluster's hosts: the agent, the hostfile, the mpirun flags.

mpirun itself runs on host 0, as it would on a real cluster's first node, and
starts a daemon on every other host through its rsh agent. On a real
cluster that agent is ``ssh``; here it is a script that runs the daemon's
command inside the host's namespace, with the host's address as its
hostname and the host's own cores::

    mpirun (ns h0, hostname 10.213.0.1, cores 0)      ranks of host 0
      |-- agent 10.213.0.2 "prted ..."  ->  ip netns exec PREFIX-h1
      |                                     unshare --uts: hostname 10.213.0.2
      |                                     taskset -c 1 prted ...  ranks of host 1

Flags, and why each is needed:

* ``--host A:k,B:k --map-by ppr:k:node:OVERSUBSCRIBE``: k ranks on each host.
  ``--oversubscribe`` alone put every rank on the first host.
* ``--bind-to none``: the cpuset of the host is the binding. Each host sees
  every core of the machine, so mpirun's own binding put the first rank of
  *each* host on core 0, and a 4 KiB allreduce across hosts took 8.1 ms (a
  scheduler time slice) against 36 us unbound.
* ``--mca mpi_yield_when_idle 1``: a host has fewer cores than ranks, so a
  waiting rank must give its core away; spinning took 179 ms per 4 KiB
  allreduce at 2 hosts x 2 ranks on 2 cores, 295 us yielding (issue 26).
* ``btl_tcp_if_include`` / ``oob_tcp_if_include eth0``: only the cluster's links.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from ..errors import ClusterError
from .net import Cluster, save, state_dir

__all__ = ["write_files", "mpirun_flags", "wrap", "ranks_per_host", "local_env", "describe"]

_AGENT = """#!/bin/sh
# allreduce-cluster agent for prefix {prefix}: Open MPI calls it like ssh, as AGENT [options] HOST COMMAND...
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "allreduce-cluster agent ({prefix}): unknown host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c \\
  'hostname "$1" && cores=$2 && shift 2 && exec taskset -c "$cores" /bin/sh -c "$*"' agent "$host" "$cores" "$@"
"""


def write_files(cluster: Cluster) -> Path:
    """Write the state, the agent and the hostfile under the cluster's state folder; return it."""
    d = save(cluster)
    cases = "\n".join(f"  {h.address}) ns={h.name} cores={','.join(map(str, h.cores))};;" for h in cluster.hosts)
    agent = d / "agent"
    agent.write_text(_AGENT.format(prefix=cluster.prefix, cases=cases))
    agent.chmod(0o755)
    (d / "hostfile").write_text("".join(f"{h.address} slots={cluster.slots}\n" for h in cluster.hosts))
    return d


def ranks_per_host(cluster: Cluster, np_: int) -> int:
    """Ranks on each host for ``np_`` ranks spread evenly (the last host may get fewer)."""
    n = len(cluster.hosts)
    if np_ < n:
        raise ClusterError(f"-np {np_} is fewer than the cluster's {n} hosts; give at least one rank per host "
                           f"(or bring up a smaller cluster: allreduce-cluster up --nodes {np_})")
    return -(-np_ // n)


def mpirun_flags(cluster: Cluster, np_: int) -> list[str]:
    """The mpirun flags that place ``np_`` ranks over the cluster's hosts, each on its own cores."""
    k = ranks_per_host(cluster, np_)
    hosts = ",".join(f"{h.address}:{max(k, cluster.slots)}" for h in cluster.hosts)
    agent = state_dir(cluster.prefix) / "agent"
    return ["--host", hosts, "--map-by", f"ppr:{k}:node:OVERSUBSCRIBE", "--bind-to", "none",
            "--mca", "plm_rsh_agent", str(agent), "--mca", "mpi_yield_when_idle", "1",
            "--mca", "btl_tcp_if_include", "eth0", "--prtemca", "oob_tcp_if_include", "eth0"]


def wrap(cluster: Cluster, cmd: list[str]) -> list[str]:
    """``cmd`` (an mpirun command line) run on host 0: its namespace, hostname and cores."""
    h = cluster.hosts[0]
    if not (state_dir(cluster.prefix) / "agent").exists():
        raise ClusterError(f"the cluster {cluster.prefix!r} has no agent script; run `allreduce-cluster up` again")
    return ["ip", "netns", "exec", h.name, "unshare", "--uts", "/bin/sh", "-c",
            'hostname "$1" && cores=$2 && shift 2 && exec taskset -c "$cores" "$@"', "mpirun-host0",
            h.address, ",".join(map(str, h.cores)), *cmd]


def local_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment for a cluster job: without ``ALLREDUCE_FAKE_NODE_SIZE`` (the hosts are real nodes)."""
    return {k: v for k, v in environ.items() if k != "ALLREDUCE_FAKE_NODE_SIZE"}


def describe(cluster: Cluster, np_: int, cmd: list[str]) -> str:
    """One line saying where a launch goes, for --dry-run and logs."""
    k = ranks_per_host(cluster, np_)
    return (f"# cluster {cluster.prefix}: {len(cluster.hosts)} hosts x {k} ranks, link {cluster.link}\n"
            + shlex.join(cmd))



def split_flag(passthrough: list[str]) -> tuple[list[str], str | None]:
    """Take ``--cluster`` / ``--cluster=PREFIX`` out of allreduce-run's mpirun flags: ``(rest, prefix or None)``."""
    from .net import DEFAULT_PREFIX
    rest, prefix = [], None
    for arg in passthrough:
        if arg == "--cluster":
            prefix = DEFAULT_PREFIX
        elif arg.startswith("--cluster="):
            prefix = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return rest, prefix


def command_for(prefix: str, np_: int, passthrough: list[str], command: list[str], *, build, mpirun: str,
                environ: dict[str, str]) -> list[str]:
    """allreduce-run's command line for ``np_`` ranks over the cluster ``prefix``.

    ``build`` is :func:`allreduce.run.build_command` (passed in: the launcher sits above this module).
    """
    from .net import load
    cluster = load(prefix)
    if cluster is None:
        raise ClusterError(f"no cluster with prefix {prefix!r} is up: run `allreduce-cluster up --nodes N` first")
    cmd = build(np_, [*passthrough, *mpirun_flags(cluster, np_)], command, mpirun=mpirun,
                environ=local_env(environ))
    return wrap(cluster, cmd)
