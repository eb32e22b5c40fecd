"""``allreduce-cluster``: bring a cluster of namespace hosts up, show it, take it down.

::

    allreduce-cluster up --nodes 2 --link 1gbit --slots 2    # hosts, shaped links, measured stream
    allreduce-run --cluster -np 4 python train.py             # 2 ranks on each host
    allreduce-cluster status
    allreduce-cluster down                                    # also after a crash or a half-made up

``up`` is idempotent: the same arguments again reuse what is up; other
arguments replace it. Needs root (network namespaces); elsewhere it says so
in one line and exits 1. ``--prefix`` names a second, separate cluster.
"""
from __future__ import annotations

import argparse
import re
import sys

from ..errors import ClusterError
from . import net, probe
from .launch import write_files

__all__ = ["main", "up", "status_lines"]


def _prefix(text: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", text):
        raise argparse.ArgumentTypeError("a prefix is 1 to 6 lowercase letters or digits, starting with a letter "
                                         "(interface names are at most 15 characters)")
    return text


def _intact(cluster: net.Cluster) -> bool:
    spaces, links = net.existing(cluster.prefix)
    return (sorted(spaces) == sorted(h.name for h in cluster.hosts)
            and set(links) >= {cluster.bridge, *(h.name for h in cluster.hosts)}
            and (net.state_dir(cluster.prefix) / "agent").exists())


def up(*, nodes: int, link: str = "1gbit", slots: int = 1, prefix: str = net.DEFAULT_PREFIX,
       seconds: float = 1.0) -> net.Cluster:
    """Bring the cluster up (or keep it, when the same one is up already) and measure its link."""
    if nodes < 1:
        raise ClusterError(f"--nodes {nodes}: a cluster needs at least 1 host")
    if slots < 1:
        raise ClusterError(f"--slots {slots}: each host needs at least 1 slot")
    net.parse_rate(link)
    old = net.load(prefix)
    if old is not None and _intact(old) and (len(old.hosts), old.link, old.slots) == (nodes, link, slots):
        return old
    net.down(prefix)                       # a different cluster, or what a crashed `up` left
    try:
        cluster = net.up_links(prefix, nodes, link, slots)
        write_files(cluster)
        cluster.measured = probe.measure(cluster, seconds=seconds)
        write_files(cluster)
    except BaseException:
        net.down(prefix)
        raise
    return cluster


def status_lines(cluster: net.Cluster) -> list[str]:
    bound = net.parse_rate(cluster.link)
    m = cluster.measured
    lines = [f"cluster {cluster.prefix}: {len(cluster.hosts)} hosts on {cluster.subnet}, link "
             f"{cluster.link}" + (f" ({bound / 1e9:g} Gbit/s each way)" if bound else " (unshaped veth)")
             + f", {cluster.slots} slot(s) per host, files in {net.state_dir(cluster.prefix)}"]
    for h in cluster.hosts:
        lines.append(f"  {h.name:10s} {h.address:15s} cores {','.join(map(str, h.cores))}")
    if m.get("stream_gbit_s") is not None:
        lines.append(f"  one TCP stream {cluster.hosts[0].name} -> {cluster.hosts[1].name}: "
                     f"{m['stream_gbit_s']:.3f} Gbit/s, round trip {m['rtt_us']:.0f} us (8 B)")
    elif m.get("error"):
        lines.append(f"  link probe failed: {m['error']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="allreduce-cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=_prefix, default=net.DEFAULT_PREFIX,
                        help=f"name prefix of everything made (default {net.DEFAULT_PREFIX})")
    sub = parser.add_subparsers(dest="what", required=True)
    p_up = sub.add_parser("up", help="make the hosts and links (idempotent)")
    p_up.add_argument("--nodes", type=int, required=True, help="number of hosts")
    p_up.add_argument("--link", default="1gbit", help="each host's link rate, as tc writes it (1gbit, 10gbit, "
                                                      "none); default 1gbit")
    p_up.add_argument("--slots", type=int, default=1, help="ranks per host the hostfile offers (default 1)")
    p_up.add_argument("--probe-seconds", type=float, default=1.0, help="length of the TCP stream measurement")
    sub.add_parser("down", help="remove everything with the prefix, processes inside included")
    sub.add_parser("status", help="show what is up")
    args = parser.parse_args(argv)
    try:
        if args.what == "up":
            cluster = up(nodes=args.nodes, link=args.link, slots=args.slots, prefix=args.prefix,
                         seconds=args.probe_seconds)
            print("\n".join(status_lines(cluster)))
        elif args.what == "down":
            removed = net.down(args.prefix)
            print(f"removed: {', '.join(removed)}" if removed else f"nothing with prefix {args.prefix!r} was up")
        else:
            cluster = net.load(args.prefix)
            spaces, links = net.existing(args.prefix)
            if cluster is None and not spaces and not links:
                print(f"no cluster with prefix {args.prefix!r} is up")
                return 3
            if cluster is not None:
                print("\n".join(status_lines(cluster)))
            if cluster is None or not _intact(cluster):
                print(f"  incomplete: namespaces {spaces}, links {links}; run `allreduce-cluster down`")
                return 2
    except ClusterError as exc:
        print(f"allreduce-cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
