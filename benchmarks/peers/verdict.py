"""The peer goal (issue 28): every one of our rows ahead of both peers, training included.

A ratio is the peer's time over ours (for training: our img/s over Horovod's), so above
1.00x ours is ahead. Per measure and per row of ours, the line gives the worst ratio
over sizes against each peer, and met when both are >= 1.0x.
"""
from __future__ import annotations

import statistics

from benchmarks.peers.timing import MEASURES, OURS, PEERS

__all__ = ["ratios", "peer_goals", "hooks_goal"]

_WHAT = {"latency": "latency of one named 4 KiB tensor",
         "grouped": "1000 x 4 KiB grouped",
         "busbw": "busbw 1 KiB..64 MiB, worst size"}
_LABEL = {"ours": "ours (tfops)", "ours-np": "ours (numpy)", "gloo": "Gloo", "horovod": "Horovod"}


def ratios(records: list[dict], measure: str, ours: str, peer: str) -> dict[int, float]:
    """{size: peer time / our time} at every size both timed."""
    t = {(r["impl"], r["size_bytes"]): r["time_us"] for r in records if r["measure"] == measure}
    return {s: t[(peer, s)] / t[(ours, s)] for (impl, s) in sorted(t)
            if impl == ours and (peer, s) in t and t[(ours, s)] > 0}


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def peer_goals(data: dict) -> list[str]:
    """The goal lines for one peers section (its JSON): one per measure and row of ours, and training."""
    records, skipped = data.get("records", []), data.get("skipped", {})
    lines = []
    for measure in MEASURES:
        for ours in OURS:
            cells, met = [], True
            for peer in PEERS:
                per = ratios(records, measure, ours, peer)
                if not per:
                    why = skipped.get(peer, "no row for both")
                    cells.append(f"{_LABEL[peer]} not measured ({why})")
                    met = False
                    continue
                worst = min(per, key=per.get)
                where = f" at {_size(worst)}" if len(per) > 1 else ""
                cells.append(f"{_LABEL[peer]} **{per[worst]:.2f}x**{where}")
                met = met and per[worst] >= 1.0
            lines.append(f"- peers, {_WHAT[measure]}, {_LABEL[ours]} ahead of both (peer time / ours, goal >= 1.0x "
                         f"against each): {'; '.join(cells)}: " + ("**met**." if met else "**not met**."))
    lines.append(training_goal(data))
    return lines


def hooks_goal(data: dict) -> str:
    """Issue 32's peers line: which library runs the communication hooks (PowerSGD, 1-bit).
    Horovod's compressors come from its own module, recorded by horovod_bench.py; a run made
    before it recorded them falls back to Horovod 0.28.1's source."""
    import allreduce as ar
    ours = [name for name in ("PowerSGD", "OneBit") if isinstance(getattr(ar, name, None), type)
            and issubclass(getattr(ar, name), ar.CommHook)] if hasattr(ar, "CommHook") else []
    hvd = data.get("versions", {}).get("horovod", {})
    found = hvd.get("compressors")
    where = ("recorded by horovod_bench.py from hvd.Compression" if found else
             "horovod/tensorflow/compression.py of 0.28.1; horovod_bench.py records them at the next peers run")
    found = found or ["fp16", "none"]
    return (f"- peers, communication hooks (issue 32): ours runs {' and '.join(ours) or 'neither'} "
            f"(`comm_hook=`; the hooks section); Horovod {hvd.get('horovod', '0.28.1')} cannot run either hook: "
            f"its Compression has {', '.join(found)} ({where}), each a compress/decompress pair around one allreduce per "
            "tensor, with no step that runs collectives of its own or keeps state across steps.")


def training_goal(data: dict) -> str:
    """tfops img/s over Horovod's, medians of the launches (different TF and Keras: said so)."""
    train = data.get("training", {})
    ours, hvd = train.get("ours") or [], train.get("horovod") or []
    versions = data.get("versions", {}).get("horovod-training", {})
    against = (f"Horovod on TF {versions.get('tensorflow', '2.12')} / Keras {versions.get('keras', '2')}, ours on "
               "TF 2.21 / Keras 3")
    if not ours or not hvd:
        why = data.get("skipped", {}).get("horovod", "no training launches in this run")
        return f"- peers, training img/s, tfops / Horovod, -np 2: not measured ({why})."
    ratio = statistics.median(ours) / statistics.median(hvd)
    return (f"- peers, training img/s, tfops / Horovod, same model, batch and loop, -np 2, one thread per rank "
            f"({against}): **{ratio:.2f}x** (goal >= 1.0x): " + ("**met**." if ratio >= 1.0 else "**not met**.")
            + f" ({statistics.median(ours):.1f} against {statistics.median(hvd):.1f} img/s, medians of "
              f"{len(ours)} and {len(hvd)} launches; Gloo's training path is torch DDP, not run)")
