"""Hosts made of network namespaces on one bridge, each link shaped by a token bucket.

::

    root namespace:          PREFIX-br (bridge, no address)
                             /        |         \\
                       PREFIX-h0  PREFIX-h1  PREFIX-h2      veth ends, tbf on egress (into the host)
                           |          |          |
    namespace PREFIX-h0:  eth0 10.213.0.1/24  ...          the other veth end, tbf on egress (out of it)

Each host is a namespace with one veth into the bridge. A ``tbf`` qdisc on
both ends of the veth shapes the link in both directions (netem, which would
add delay, is not in every kernel; tbf is). Addresses come from the first
private /24 in ``CANDIDATES`` that no address or route of the root namespace
overlaps, and the bridge has none, so traffic between hosts never leaves the
namespaces made here. Every name starts with the prefix, so :func:`down`
finds what an interrupted :func:`up` left by name, without the state file.

Each host also gets its own cores (``cores_for``): a namespace does not hide
the machine's CPUs, so without a cpuset per host every host believes it owns
all of them and Open MPI binds the first rank of every host to core 0.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ClusterError

__all__ = ["Cluster", "Host", "up_links", "down", "existing", "kill_inside", "check_permitted", "cores_for",
           "state_dir", "load", "save", "DEFAULT_PREFIX", "parse_rate"]

DEFAULT_PREFIX = "arcl"
CANDIDATES = [f"10.213.{i}.0/24" for i in range(0, 256, 17)] + ["192.168.213.0/24", "172.30.213.0/24"]
# tbf needs a bucket of at least one packet and, to reach its rate, of about what the rate
# sends in a timer tick; 512 KiB holds 4 ms at 1 Gbit/s, and faster links get 2 ms of rate.
_MIN_BURST = 512 << 10
_LATENCY = "20ms"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclass
class Host:
    name: str           #: namespace name, PREFIX-hI
    address: str        #: its address on the cluster's /24 (also its hostname while it runs ranks)
    cores: list[int]    #: the CPUs its ranks run on


@dataclass
class Cluster:
    prefix: str
    subnet: str
    link: str                            #: tbf rate as given ("1gbit"), or "none" for an unshaped veth
    slots: int
    hosts: list[Host]
    measured: dict = field(default_factory=dict)   #: one TCP stream between two hosts (probe.py)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``10gbit``, ``500mbit``; 0 for ``none``."""
    t = text.strip().lower()
    if t in ("none", "0", "unshaped"):
        return 0.0
    if not t.endswith("bit"):
        raise ClusterError(f"link rate {text!r}: write it as tc does, e.g. 1gbit, 10gbit, 500mbit, or none")
    num, unit = t[:-3], ""
    if num and num[-1] in _UNITS:
        num, unit = num[:-1], num[-1]
    try:
        return float(num) * _UNITS[unit]
    except ValueError:
        raise ClusterError(f"link rate {text!r}: write it as tc does, e.g. 1gbit, 10gbit, 500mbit, or none") \
            from None


def state_dir(prefix: str) -> Path:
    base = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    return base / f"allreduce-cluster-{prefix}"


def load(prefix: str) -> Cluster | None:
    path = state_dir(prefix) / "state.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    raw["hosts"] = [Host(**h) for h in raw["hosts"]]
    return Cluster(**raw)


def save(cluster: Cluster) -> Path:
    d = state_dir(cluster.prefix)
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text(json.dumps(asdict(cluster), indent=1))
    return d


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise ClusterError(f"`{' '.join(cmd)}` failed: {err[-1] if err else proc.returncode}")
    return proc


def existing(prefix: str) -> tuple[list[str], list[str]]:
    """``(namespaces, links)`` on this machine whose names carry ``prefix``."""
    out = _ip("ip", "netns", "list", check=False).stdout.split("\n")
    spaces = [line.split()[0] for line in out if line.startswith(prefix + "-")]
    links = []
    for line in _ip("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix + "-"):
            links.append(name)
    return spaces, links


def cores_for(nodes: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Each host's CPUs: disjoint groups while there are enough, else one CPU each, dealt in turn."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if nodes <= len(cpus):
        per = len(cpus) // nodes
        return [cpus[i * per:(i + 1) * per] for i in range(nodes)]
    return [[cpus[i % len(cpus)]] for i in range(nodes)]


def _free_subnet() -> str:
    """The first candidate /24 that no address or route of the root namespace overlaps."""
    used = []
    for line in _ip("ip", "-4", "-o", "addr", "show", check=False).stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for line in _ip("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word and word[0].isdigit():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    for cand in CANDIDATES:
        net = ipaddress.ip_network(cand)
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return cand
    raise ClusterError("no free private /24 for the cluster: every candidate overlaps an address or route "
                       f"here ({', '.join(CANDIDATES[:3])}, ...)")


def _shape(dev: str, rate: str, netns: str | None) -> None:
    bits = parse_rate(rate)
    if not bits:
        return
    burst = max(_MIN_BURST, int(bits / 8 * 0.002))
    _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
        "latency", _LATENCY, netns=netns)


def check_permitted(prefix: str) -> None:
    """Raise ClusterError in one line where this process may not make network namespaces."""
    probe = f"{prefix}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
        raise ClusterError(f"network namespaces are not permitted here ({why}); allreduce-cluster needs root "
                           "(CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def up_links(prefix: str, nodes: int, link: str, slots: int) -> Cluster:
    """Make the bridge, the hosts and their shaped links; return the cluster (not yet saved)."""
    parse_rate(link)
    check_permitted(prefix)
    subnet = ipaddress.ip_network(_free_subnet())
    addrs = list(subnet.hosts())
    cluster = Cluster(prefix, str(subnet), link, slots,
                      [Host(f"{prefix}-h{i}", str(addrs[i]), cores) for i, cores in enumerate(cores_for(nodes))])
    save(cluster)                                      # so `down` knows the prefix even if we stop here
    _ip("ip", "link", "add", cluster.bridge, "type", "bridge")
    _ip("ip", "link", "set", cluster.bridge, "up")
    for host in cluster.hosts:
        peer = f"{host.name}-p"
        _ip("ip", "netns", "add", host.name)
        _ip("ip", "link", "add", host.name, "type", "veth", "peer", "name", peer)
        _ip("ip", "link", "set", peer, "netns", host.name)
        _ip("ip", "link", "set", host.name, "master", cluster.bridge, "up")
        _ip("ip", "link", "set", peer, "name", "eth0", netns=host.name)
        _ip("ip", "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", "eth0", netns=host.name)
        _ip("ip", "link", "set", "eth0", "up", netns=host.name)
        _ip("ip", "link", "set", "lo", "up", netns=host.name)
        _shape(host.name, link, None)                  # bridge -> host: what the host receives
        _shape("eth0", link, host.name)                # host -> bridge: what the host sends
    return cluster


def kill_inside(space: str) -> list[int]:
    """Stop every process in namespace ``space`` (SIGTERM, then SIGKILL after 2 s); their pids."""
    def pids() -> list[int]:
        out = _ip("ip", "netns", "pids", space, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]
    found = pids()
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 1.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)
    return found


def down(prefix: str) -> list[str]:
    """Remove every namespace, link and file carrying ``prefix``, and the processes inside; what it removed."""
    spaces, links = existing(prefix)
    removed = []
    for space in spaces:
        killed = kill_inside(space)
        _ip("ip", "netns", "del", space, check=False)
        removed.append(f"namespace {space}" + (f" ({len(killed)} processes stopped)" if killed else ""))
    for name in links:                                 # deleting one veth end deletes its peer
        if _ip("ip", "link", "del", name, check=False).returncode == 0:
            removed.append(f"link {name}")
    d = state_dir(prefix)
    if d.exists():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
        removed.append(f"state {d}")
    return removed
