"""The timeline file: valid JSON, one row per tensor, negotiation ticks and algorithm phases."""
import json

import numpy as np

from allreduce.engine import Compression, PowerSGD
from allreduce.engine.timeline import TimelineTransport, timeline_path
from allreduce.transport.threads import ThreadWorld

from .engine_util import engines, submit_all, wait_all


def test_timeline_has_every_stage_and_the_ring_phases(tmp_path):
    path = tmp_path / "tl.json"
    inputs = {f"g{i}": [np.full(300 + i, r, np.float32) for r in range(3)] for i in range(4)}
    with engines(3, timeline=str(path), algorithm="ring", fusion_threshold=1 << 20) as engs:
        for step in range(3):
            wait_all(submit_all(engs, inputs, np.random.default_rng(step)))
        wait_all(submit_all(engs, {"half": [np.ones(50, np.float32)] * 3}, compression=Compression.fp16))
        hook = PowerSGD(rank=1, start_iter=0)              # one object for the 3 engines: state per communicator
        wait_all(submit_all(engs, {"low": [np.ones((8, 8), np.float32)] * 3}, comm_hook=hook))
    files = [path, tmp_path / "tl.rank1.json", tmp_path / "tl.rank2.json"]
    for rank, file in enumerate(files):
        events = json.loads(file.read_text())
        assert {e["pid"] for e in events} == {rank}
        rows = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
        assert set(rows) == set(inputs) | {"half", "low"}
        g0 = [e for e in events if e.get("tid") == rows["g0"]]
        names = {e["name"] for e in g0}
        assert {"QUEUE", "NEGOTIATE", "WAIT_FOR_BATCH", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                "reduce-scatter", "allgather", "MEMCPY_OUT_FUSION_BUFFER"} <= names
        ticks = {e["args"]["rank"] for e in g0 if e["ph"] == "i"}
        assert ticks == {0, 1, 2}, "one negotiation tick per ready rank"
        allreduce = [e for e in g0 if e["name"] == "ALLREDUCE"]
        assert len(allreduce) == 3 and all(e["args"]["algorithm"] == "ring" for e in allreduce)
        assert all(e["args"]["batch_tensors"] == 4 for e in allreduce), "the four tensors are fused"
        phases = [e for e in g0 if e["name"] in ("reduce-scatter", "allgather")]
        assert all(e["args"]["steps"] == 2 for e in phases)          # p - 1 steps each
        half = {e["name"] for e in events if e.get("tid") == rows["half"]}
        assert {"COMPRESS", "DECOMPRESS"} <= half
        hooked = [e for e in events if e.get("tid") == rows["low"] and e["name"] == "COMM_HOOK"]
        assert len(hooked) == 1 and hooked[0]["args"]["hook"].startswith("PowerSGD(rank=1,")


def test_timeline_path_per_rank():
    assert str(timeline_path("/x/tl.json", 0)) == "/x/tl.json"
    assert str(timeline_path("/x/tl.json", 3)) == "/x/tl.rank3.json"
    assert str(timeline_path("/x/trace", 1)) == "/x/trace.rank1.json"


def test_timeline_transport_merges_steps_into_phases():
    t = TimelineTransport(ThreadWorld(1).transport(0))
    t.mark("ignored", 0)
    t.record()
    for phase, step in [("reduce-scatter", 0), ("reduce-scatter", 1), ("allgather", 0)]:
        t.mark(phase, step)
    spans = t.stop(end=1e12)
    assert [(s[0], s[3]) for s in spans] == [("reduce-scatter", 2), ("allgather", 1)]
    assert spans[0][2] == spans[1][1] and spans[1][2] == 1e12
