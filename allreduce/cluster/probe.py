"""What a cluster link delivers: one TCP stream's rate and an 8-byte round trip, between two hosts.

::

    host h1:  python allreduce/cluster/probe.py serve ADDR PORT
    host h0:  python allreduce/cluster/probe.py send ADDR PORT SECONDS    -> one JSON line

Steps:
  1. 200 round trips of 8 bytes (the median is the link's latency, alpha ~ rtt/2);
  2. the client streams 1 MiB writes for SECONDS, then shuts its side down;
  3. the server answers with the bytes it read and the time from its first to its last read,
     so the rate is what arrived (beta = 1/rate), not what the client's socket buffer took.

:func:`measure` runs both ends inside the cluster's namespaces, on each host's own cores.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

__all__ = ["measure"]

_PINGS = 200
_CHUNK = 1 << 20


def _serve(addr: str, port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(_PINGS):                       # 1: echo each 8-byte ping
        conn.sendall(_recv_exact(conn, 8))
    buf, total, first, last = bytearray(_CHUNK), 0, None, None
    while True:                                   # 2: count the stream until the client shuts down
        n = conn.recv_into(buf)
        if not n:
            break
        last = time.perf_counter()
        first = first or last
        total += n
    conn.sendall(struct.pack("!qd", total, (last or 0) - (first or 0)))   # 3: what arrived, and when
    conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("peer closed during the round trips")
        data += part
    return data


def _send(addr: str, port: int, seconds: float) -> dict:
    conn = socket.create_connection((addr, port), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(_PINGS):
        t = time.perf_counter()
        conn.sendall(b"x" * 8)
        _recv_exact(conn, 8)
        rtts.append(time.perf_counter() - t)
    chunk = b"\0" * _CHUNK
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.sendall(chunk)
    conn.shutdown(socket.SHUT_WR)
    total, elapsed = struct.unpack("!qd", _recv_exact(conn, 16))
    rtts.sort()
    return {"stream_gbit_s": round(total * 8 / elapsed / 1e9, 3) if elapsed > 0 else 0.0,
            "rtt_us": round(rtts[len(rtts) // 2] * 1e6, 1), "bytes": total, "seconds": round(elapsed, 3)}


def _in_host(host, argv: list[str]) -> list[str]:
    cores = ",".join(map(str, host.cores))
    return ["ip", "netns", "exec", host.name, "taskset", "-c", cores, sys.executable, __file__, *argv]


def measure(cluster, *, seconds: float = 1.0, port: int = 5299) -> dict:
    """Stream from the cluster's host 0 to host 1 and time round trips; ``{}`` with fewer than 2 hosts."""
    if len(cluster.hosts) < 2:
        return {}
    a, b = cluster.hosts[0], cluster.hosts[1]
    server = subprocess.Popen(_in_host(b, ["serve", b.address, str(port)]), stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            return {"error": "the probe's server did not start"}
        out = subprocess.run(_in_host(a, ["send", b.address, str(port), str(seconds)]), capture_output=True,
                             text=True, timeout=seconds + 60)
        if out.returncode != 0:
            return {"error": (out.stderr.strip().splitlines() or ["probe failed"])[-1]}
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(_send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
