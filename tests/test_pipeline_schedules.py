"""Pipeline schedules (allreduce/schedules): pure and fast, no TensorFlow.

Property checks over p, m, v: every micro-batch is forwarded and backwarded once per chunk, a
backward never precedes its forward, sends match receives channel by channel, the simulated
bubble equals (p-1)/(v m), GPipe keeps m activations and 1F1B at most p, and the explain CLI
prints the grid from the same lists.
"""
import itertools

import pytest

from allreduce.errors import InvalidArgumentError
from allreduce.explain.__main__ import main as explain_main
from allreduce.schedules import simulate, stage_actions
from allreduce.schedules.grid import check_messages
from allreduce.schedules.pipeline import schedule

CASES = [(name, p, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16))
         if name != "interleaved" or (p >= 2 and m % p == 0)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_properties(name, p, m, v):
    for r in range(p):
        order = schedule(name, p, m, r, v)
        pairs = {(i, c) for i in range(m) for c in range(v)}
        assert sorted((i, c) for k, i, c in order if k == "F") == sorted(pairs), "each (mb, chunk) forwarded once"
        assert sorted((i, c) for k, i, c in order if k == "B") == sorted(pairs), "each (mb, chunk) backwarded once"
        seen = set()
        for k, i, c in order:
            if k == "F":
                seen.add((i, c))
            else:
                assert (i, c) in seen, f"rank {r}: B{i}.{c} before its forward"
        for kind in "FB":                      # FIFO channels: a chunk's micro-batches ascend both ways
            for c in range(v):
                mbs = [i for k, i, cc in order if k == kind and cc == c]
                assert mbs == sorted(mbs)
    check_messages(name, p, m, v)
    grid = simulate(name, p, m, v)
    for r in range(p):
        assert grid.busy(r) == 2 * m * v
        assert grid.idle(r) == 2 * (p - 1), "unit slots: the bubble is 2(p-1) on every rank"
        assert abs(grid.bubble(r) - (p - 1) / (v * m)) < 1e-12, (r, grid.bubble(r))
    if name == "gpipe":
        assert grid.peak == [m] * p
    if name == "1f1b":
        assert grid.peak == [min(p - r, m) for r in range(p)] and max(grid.peak) <= p


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_backward_twice_forward_keeps_formula(name, v):
    # Megatron draws B as 2 slots; the bubble ratio (p-1)/(v m) does not depend on it
    grid = simulate(name, 4, 8, v, forward=1, backward=2)
    assert all(abs(grid.bubble(r) - 3 / (8 * v)) < 1e-12 for r in range(4))


def test_sends_and_receives_written_in():
    acts = stage_actions("1f1b", 2, 2, 0)
    assert [str(a) for a in acts] == ["F0.0", "send_act0.0 to 1", "F1.0", "send_act1.0 to 1",
                                      "recv_grad0.0 from 1", "B0.0", "recv_grad1.0 from 1", "B1.0"]
    last = stage_actions("interleaved", 2, 2, 1, 2)          # rank 1 chunk 0 feeds rank 0 chunk 1
    assert str(last[0]) == "recv_act0.0 from 0" and "send_act0.0 to 0" in [str(a) for a in last]


@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 4, 0, 1), "unknown pipeline schedule"),
    (("1f1b", 2, 0, 0, 1), "micro_batches must be"),
    (("1f1b", 2, 4, 0, 2), "one chunk a rank"),
    (("interleaved", 2, 4, 0, 1), "at least 2 chunks"),
    (("interleaved", 1, 4, 0, 2), "at least 2 pipeline stages"),
    (("interleaved", 4, 6, 0, 2), "multiple of the stages"),
    (("gpipe", 2, 4, 2, 1), "pipeline rank must be"),
])
def test_bad_arguments(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        schedule(*args)


def test_explain_prints_the_grid(capsys):
    assert explain_main(["pipeline", "--stages", "4", "--micro-batches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    grid = simulate("1f1b", 4, 8)
    rows = [line for line in out.splitlines() if line.startswith("stage ") and "|" in line]
    assert len(rows) == 4
    for r, row in enumerate(rows):                      # the printed cells are the simulated ones
        cells = row.split("|")[1].split()
        assert [x for x in cells if x != "."] == [f"{c.kind}{c.micro_batch}" for c in grid.cells[r]]
        assert cells.count(".") == grid.idle(r) == 6
    assert "0.375" in out
    with pytest.raises(SystemExit):
        explain_main(["pipeline", "--stages", "4", "--micro-batches", "6", "--schedule", "interleaved"])
    assert "multiple of the stages" in capsys.readouterr().err
