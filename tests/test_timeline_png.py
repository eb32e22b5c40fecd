"""The timeline renderer: a real engine timeline becomes a valid PNG; bad input gives a one-line error."""
import re
import json

import numpy as np
import pytest
from matplotlib.image import imread

from allreduce.errors import InvalidArgumentError
from allreduce.explain.timeline_png import load_timeline, main, render_timeline

from .engine_util import engines, submit_all, wait_all


@pytest.fixture(scope="module")
def engine_trace(tmp_path_factory):
    """Two steps of three tensors on 2 thread ranks, ring; a 20 ms cycle so each step is one fused batch."""
    path = tmp_path_factory.mktemp("tl") / "tl.json"
    inputs = {f"g{i}": [np.full(200 + i, r, np.float32) for r in range(2)] for i in range(3)}
    with engines(2, timeline=str(path), algorithm="ring", fusion_threshold=1 << 20, cycle_time=20) as engs:
        for step in range(2):
            wait_all(submit_all(engs, inputs, np.random.default_rng(step)))
    return path


def test_engine_timeline_renders_to_a_png(engine_trace, tmp_path, capsys):
    trace = load_timeline(engine_trace)
    assert sorted(trace.rows) == ["g0", "g1", "g2"] and trace.rank == 0
    assert [len(step) for step in trace.submissions()] == [3, 3]
    assert {"rank 0 ready", "rank 1 ready"} == {label for _, label, _ in trace.ticks}
    png = tmp_path / "tl.png"
    assert main([str(engine_trace), "--png", str(png), "--steps", "0"]) == 0
    out = capsys.readouterr().out
    # How many batches the 3 tensors form depends on which cycle saw them ready (thread timing).
    assert re.fullmatch(re.escape(f"{png}: last step: 3 tensors reduced in ") + r"[123] allreduce\(s\); "
                        r"[0-2] of 3 started before the last submission\n", out), out
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05, "the image is not blank"


def test_a_trace_still_being_written_is_read(engine_trace, tmp_path):
    lines = engine_trace.read_text().splitlines()
    assert lines[-1] == "]"
    partial = tmp_path / "partial.json"
    partial.write_text("\n".join(lines[:-2]) + "\n")            # no timeline_end, no closing bracket
    with pytest.raises(ValueError):
        json.loads(partial.read_text())
    assert len(load_timeline(partial).spans) == len(load_timeline(engine_trace).spans)


def _event(name, tid, ts, dur=None, **args):
    e = {"name": name, "ph": "X" if dur is not None else "i", "pid": 0, "tid": tid, "ts": ts}
    if dur is not None:
        e["dur"] = dur
    if args:
        e["args"] = args
    return e


def test_overlap_counts_allreduces_started_before_the_last_submission(tmp_path):
    # "b" is submitted first and reduced at 300 us, before "a" is submitted at 500 us: 1 of 2 overlaps.
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
              for t, n in [(1, "b"), (2, "a")]]
    events += [_event("QUEUE", 1, 0, 100), _event("ALLREDUCE", 1, 300, 50, batch_tensors=1),
               _event("QUEUE", 2, 500, 100), _event("rank 1 ready", 2, 550, rank=1),
               _event("ALLREDUCE", 2, 700, 50, batch_tensors=1)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    summary = render_timeline(load_timeline(path), tmp_path / "t.png")
    assert summary == "last step: 2 tensors reduced in 2 allreduce(s); 1 of 2 started before the last submission"
    assert imread(tmp_path / "t.png").ndim == 3


@pytest.mark.parametrize("content, message", [
    (None, "cannot read timeline"),
    ("not json at all", "is not a timeline"),
    ('{"a": 1}', "is not a timeline"),
    ("[1, 2]", "is not a timeline"),
    ('[{"name": "process_name", "ph": "M", "pid": 0}]', "holds no spans"),
])
def test_bad_input_gives_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=message):
        load_timeline(path)
    assert main([str(path), "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert err.startswith("python -m allreduce.explain.timeline_png: error:")
    assert not (tmp_path / "x.png").exists()


def test_negative_steps_is_refused(engine_trace, tmp_path):
    with pytest.raises(InvalidArgumentError, match="steps must be >= 0"):
        render_timeline(load_timeline(engine_trace), tmp_path / "x.png", steps=-1)
