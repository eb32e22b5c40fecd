"""allreduce-explain: the printed symbolic states against tables derived by hand, figures, bad args.

The expected tables below were written from the algorithm definitions (the
module docstrings and plans), not copied from the tool. A cell is written
compactly as the ranks it holds: ``"abd"`` in column 3 means ``a3+b3+d3``.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from allreduce.algorithms import ring
from allreduce.explain import explain
from allreduce.explain.__main__ import main
from allreduce.explain.text import render, totals
from allreduce.transport.base import wait_all

F3, F4 = "abc", "abcd"


def _cells(rows: list[str], labels: list[str]) -> list[list[str]]:
    """``["ab c", ...]`` -> ``[["a0+b0", "c1"], ...]`` (one string per rank, cells split by spaces)."""
    return [["+".join(f"{r}{labels[j]}" for r in cell) for j, cell in enumerate(row.split())] for row in rows]


def _parse(text: str) -> dict[str, tuple[set[str], list[list[str]]]]:
    """The printout -> {step: (set of message lines, table cells per rank)}."""
    steps: dict[str, tuple[set[str], list[list[str]]]] = {}
    name = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and (line == "start" or re.fullmatch(r"[a-z-]+ \d+", line)):
            name = line
            steps[name] = (set(), [])
        elif name and re.match(r"  \d+ -> \d+  ", line):
            steps[name][0].add(line.strip())
        elif name and line.startswith("  rank "):
            steps[name][1].append(line.split()[2:])
        elif line.startswith("totals"):
            name = None
    return steps


def _check(algorithm: str, p: int, count: int, expected: list[tuple[str, list[str], list[str]]],
           labels: list[str]) -> None:
    got = _parse(render(explain(algorithm, p, count)))
    assert list(got) == [name for name, _, _ in expected], "steps differ"
    for name, msgs, rows in expected:
        assert got[name][0] == set(msgs), f"{name}: messages differ"
        assert got[name][1] == _cells(rows, labels), f"{name}: states differ"


def test_ring_3_ranks():
    # Reduce-scatter step s: rank r sends chunk (r - s) % p right. Allgather step s: chunk (r + 1 - s) % p.
    _check("ring", 3, 3, [
        ("start", [], ["a a a", "b b b", "c c c"]),
        ("reduce-scatter 0", ["0 -> 1  chunk 0  a0", "1 -> 2  chunk 1  b1", "2 -> 0  chunk 2  c2"],
         ["a a ac", "ab b b", "c bc c"]),
        ("reduce-scatter 1", ["0 -> 1  chunk 2  a2+c2", "1 -> 2  chunk 0  a0+b0", "2 -> 0  chunk 1  b1+c1"],
         ["a abc ac", "ab b abc", "abc bc c"]),
        ("allgather 0", ["0 -> 1  chunk 1  a1+b1+c1", "1 -> 2  chunk 2  a2+b2+c2", "2 -> 0  chunk 0  a0+b0+c0"],
         [f"{F3} {F3} ac", f"ab {F3} {F3}", f"{F3} bc {F3}"]),
        ("allgather 1", ["0 -> 1  chunk 0  a0+b0+c0", "1 -> 2  chunk 1  a1+b1+c1", "2 -> 0  chunk 2  a2+b2+c2"],
         [f"{F3} {F3} {F3}"] * 3),
    ], ["0", "1", "2"])


def test_ring_4_ranks():
    _check("ring", 4, 4, [
        ("start", [], ["a a a a", "b b b b", "c c c c", "d d d d"]),
        ("reduce-scatter 0", ["0 -> 1  chunk 0  a0", "1 -> 2  chunk 1  b1", "2 -> 3  chunk 2  c2",
                              "3 -> 0  chunk 3  d3"],
         ["a a a ad", "ab b b b", "c bc c c", "d d cd d"]),
        ("reduce-scatter 1", ["0 -> 1  chunk 3  a3+d3", "1 -> 2  chunk 0  a0+b0", "2 -> 3  chunk 1  b1+c1",
                              "3 -> 0  chunk 2  c2+d2"],
         ["a a acd ad", "ab b b abd", "abc bc c c", "d bcd cd d"]),
        ("reduce-scatter 2", ["0 -> 1  chunk 2  a2+c2+d2", "1 -> 2  chunk 3  a3+b3+d3",
                              "2 -> 3  chunk 0  a0+b0+c0", "3 -> 0  chunk 1  b1+c1+d1"],
         [f"a {F4} acd ad", f"ab b {F4} abd", f"abc bc c {F4}", f"{F4} bcd cd d"]),
        ("allgather 0", ["0 -> 1  chunk 1  a1+b1+c1+d1", "1 -> 2  chunk 2  a2+b2+c2+d2",
                         "2 -> 3  chunk 3  a3+b3+c3+d3", "3 -> 0  chunk 0  a0+b0+c0+d0"],
         [f"{F4} {F4} acd ad", f"ab {F4} {F4} abd", f"abc bc {F4} {F4}", f"{F4} bcd cd {F4}"]),
        ("allgather 1", ["0 -> 1  chunk 0  a0+b0+c0+d0", "1 -> 2  chunk 1  a1+b1+c1+d1",
                         "2 -> 3  chunk 2  a2+b2+c2+d2", "3 -> 0  chunk 3  a3+b3+c3+d3"],
         [f"{F4} {F4} acd {F4}", f"{F4} {F4} {F4} abd", f"abc {F4} {F4} {F4}", f"{F4} bcd {F4} {F4}"]),
        ("allgather 2", ["0 -> 1  chunk 3  a3+b3+c3+d3", "1 -> 2  chunk 0  a0+b0+c0+d0",
                         "2 -> 3  chunk 1  a1+b1+c1+d1", "3 -> 0  chunk 2  a2+b2+c2+d2"],
         [f"{F4} {F4} {F4} {F4}"] * 4),
    ], ["0", "1", "2", "3"])


def test_tree_3_ranks():
    # p = 3: both trees on ranks 0, 1; rank 2 a leaf under each root. Tree 0 (root 0, partner 1) carries
    # chunk 0 (buf[:2]), tree 1 (root 1, partner 0) chunk 1. Reduce up; the top edge 0 -- 1 swaps partial
    # sums, and both ends finish; then the roots send the finished chunks down to rank 2.
    _check("tree", 3, 4, [
        ("start", [], ["a a", "b b", "c c"]),
        ("reduce 0", ["2 -> 0  chunk 0  c0", "1 -> 0  chunk 0  b0", "0 -> 1  chunk 0  a0+c0",
                      "2 -> 1  chunk 1  c1", "0 -> 1  chunk 1  a1", "1 -> 0  chunk 1  b1+c1"],
         ["abc abc", "abc abc", "c c"]),
        ("broadcast 0", ["0 -> 2  chunk 0  a0+b0+c0", "1 -> 2  chunk 1  a1+b1+c1"],
         [f"{F3} {F3}"] * 3),
    ], ["0", "1"])


def test_tree_4_ranks():
    # Tree 0: 0 <- 2 <- {1, 3} over chunk 0. Tree 1, its mirror r -> 3 - r: 3 <- 1 <- {0, 2} over chunk 1.
    # The top edges (0 -- 2, 3 -- 1) swap; the partners 2 and 1 then send the finished chunks down.
    _check("tree", 4, 4, [
        ("start", [], ["a a", "b b", "c c", "d d"]),
        ("reduce 0", ["1 -> 2  chunk 0  b0", "3 -> 2  chunk 0  d0", "2 -> 0  chunk 0  b0+c0+d0", "0 -> 2  chunk 0  a0",
                      "0 -> 1  chunk 1  a1", "2 -> 1  chunk 1  c1", "1 -> 3  chunk 1  a1+b1+c1", "3 -> 1  chunk 1  d1"],
         [f"{F4} a", f"b {F4}", f"{F4} c", f"d {F4}"]),
        ("broadcast 0", ["2 -> 1  chunk 0  a0+b0+c0+d0", "2 -> 3  chunk 0  a0+b0+c0+d0",
                         "1 -> 0  chunk 1  a1+b1+c1+d1", "1 -> 2  chunk 1  a1+b1+c1+d1"],
         [f"{F4} {F4}"] * 4),
    ], ["0", "1"])


def test_rhd_3_ranks():
    # q = 2 blocks (buf[:2], buf[2:]); rank 1 folds into rank 0, rank 2 is core rank 1.
    _check("rhd", 3, 4, [
        ("start", [], ["a a", "b b", "c c"]),
        ("fold 0", ["1 -> 0  chunks 0,1  b0, b1"], ["ab ab", "b b", "c c"]),
        ("reduce-scatter 0", ["0 -> 2  chunk 1  a1+b1", "2 -> 0  chunk 0  c0"], ["abc ab", "b b", "c abc"]),
        ("allgather 0", ["0 -> 2  chunk 0  a0+b0+c0", "2 -> 0  chunk 1  a1+b1+c1"],
         [f"{F3} {F3}", "b b", f"{F3} {F3}"]),
        ("unfold 0", ["0 -> 1  chunks 0,1  a0+b0+c0, a1+b1+c1"], [f"{F3} {F3}"] * 3),
    ], ["0", "1"])


def test_rhd_4_ranks():
    # Halving: partners 0-2, 1-3 trade halves (low half stays with the lower rank), then 0-1, 2-3.
    _check("rhd", 4, 4, [
        ("start", [], ["a a a a", "b b b b", "c c c c", "d d d d"]),
        ("reduce-scatter 0", ["0 -> 2  chunks 2,3  a2, a3", "2 -> 0  chunks 0,1  c0, c1",
                              "1 -> 3  chunks 2,3  b2, b3", "3 -> 1  chunks 0,1  d0, d1"],
         ["ac ac a a", "bd bd b b", "c c ac ac", "d d bd bd"]),
        ("reduce-scatter 1", ["0 -> 1  chunk 1  a1+c1", "1 -> 0  chunk 0  b0+d0",
                              "2 -> 3  chunk 3  a3+c3", "3 -> 2  chunk 2  b2+d2"],
         [f"{F4} ac a a", f"bd {F4} b b", f"c c {F4} ac", f"d d bd {F4}"]),
        ("allgather 0", ["0 -> 1  chunk 0  a0+b0+c0+d0", "1 -> 0  chunk 1  a1+b1+c1+d1",
                         "2 -> 3  chunk 2  a2+b2+c2+d2", "3 -> 2  chunk 3  a3+b3+c3+d3"],
         [f"{F4} {F4} a a", f"{F4} {F4} b b", f"c c {F4} {F4}", f"d d {F4} {F4}"]),
        ("allgather 1", ["0 -> 2  chunks 0,1  a0+b0+c0+d0, a1+b1+c1+d1",
                         "2 -> 0  chunks 2,3  a2+b2+c2+d2, a3+b3+c3+d3",
                         "1 -> 3  chunks 0,1  a0+b0+c0+d0, a1+b1+c1+d1",
                         "3 -> 1  chunks 2,3  a2+b2+c2+d2, a3+b3+c3+d3"],
         [f"{F4} {F4} {F4} {F4}"] * 4),
    ], ["0", "1", "2", "3"])


def test_allgather_3_ranks():
    _check_collective = render(explain("ring", 3, 3, collective="allgather"))
    got = _parse(_check_collective)
    assert got["start"][1] == [["a0", ".", "."], [".", "b1", "."], [".", ".", "c2"]]
    assert got["allgather 0"][0] == {"0 -> 1  chunk 0  a0", "1 -> 2  chunk 1  b1", "2 -> 0  chunk 2  c2"}
    assert got["allgather 0"][1] == [["a0", ".", "c2"], ["a0", "b1", "."], [".", "b1", "c2"]]
    assert got["allgather 1"][1] == [["a0", "b1", "c2"]] * 3


def test_ring_docstring_table_matches_the_run():
    """ring.py's table (letters = chunks, subscripts = ranks) against the recorded reduce-scatter."""
    trace = explain("ring", 4, 4)
    rows = re.findall(r"^\s+(\d)\s+((?:[a-d]_\d[+\w]*\s+){3}[a-d]_\d[+\w]*)\s*$", ring.__doc__, re.M)
    assert len(rows) == 3, "the p = 4 table in ring.py's docstring was not found"
    for step, entries in rows:
        msgs = {m.src: m for m in trace.step_messages[trace.steps.index(("reduce-scatter", int(step)))]}
        for sender, entry in enumerate(entries.split()):
            terms = entry.split("+")
            chunk = "abcd".index(terms[0][0])
            mask = sum(1 << int(t.split("_")[1]) for t in terms)
            m = msgs[sender]
            assert m.src_loc[1] == chunk and int(m.data[0]) == mask, f"step {step}, rank {sender}: {entry}"


def test_totals_and_cost_for_ring():
    trace = explain("ring", 4, 8)
    assert totals(trace) == [(6, 96, 48)] * 4              # 2(p-1) messages of n/p; (p-1)/p n reduced
    text = render(trace)
    assert "model     T = 6 alpha + 1.5 n beta + 0.75 n gamma" in text
    assert "this run  T = 6 alpha + 1.5 n beta + 0.75 n gamma" in text
    assert "ERROR" not in text


def test_every_kind_of_reduction_is_counted():
    """rd's higher rank reduces with reduce_first_into, and shm's last reduction writes two places at
    once (reduce_finish_into_both): each is one reduction of n/p (shm) or n (rd) bytes."""
    assert totals(explain("rd", 2, 4)) == [(1, 32, 32)] * 2
    assert totals(explain("shm", 3, 6)) == [(0, 0, 32)] * 3      # (p-1) reductions of n/p = 16 bytes
    # at p = 4 one reduce_many_into call adds three peers at once: three reductions of n/p
    assert totals(explain("shm", 4, 8)) == [(0, 0, 48)] * 4
    assert totals(explain("shm-reg", 4, 8)) == [(0, 0, 48)] * 4


@pytest.mark.parametrize("p, count", [(2, 4), (3, 6), (4, 3), (5, 11)])
def test_shm_on_a_registered_buffer_reduces_in_place_with_no_copy_in(p, count):
    """shm-reg: each rank's buffer lives in shared memory, so one step does it all: reduce my chunk
    from every peer's buffer straight into mine, then push it into theirs; the same reductions as
    shm, and the same tables on every run (peers write into my buffer while I work, so the step
    is marked once, before my first post)."""
    trace = explain("shm-reg", p, count)
    assert [phase for phase, _ in trace.steps] == ["reduce+push"]
    assert totals(trace) == totals(explain("shm", p, count))
    text = render(trace)
    assert "ERROR" not in text and "no messages" in text


def _double_counting(comm, buf, op, *, workspace, segment_bytes):
    """A broken allreduce: everyone sends to everyone, and rank 0 adds its own buffer twice."""
    p, rank = comm.size, comm.rank
    comm.mark("exchange", 0)
    incoming = np.empty((p, buf.size), buf.dtype)
    sends = [comm.isend(buf.copy(), peer) for peer in range(p) if peer != rank]
    for peer in range(p):
        if peer != rank:
            comm.recv(incoming[peer], peer)
    wait_all(comm, sends)
    if rank == 0:
        incoming[0] = buf
    for peer in range(p):
        if peer != rank or rank == 0:
            buf += incoming[peer]


def test_double_count_is_flagged():
    text = render(explain(_double_counting, 3, 2))
    assert "ERROR: rank 0" in text and "counted twice" in text


def test_png_and_svg_are_valid(tmp_path):
    import matplotlib.image
    png, svg = tmp_path / "ring.png", tmp_path / "ring.svg"
    assert main(["ring", "--ranks", "3", "--count", "3", "--png", str(png), "--svg", str(svg)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05                      # not a blank canvas
    assert b"<svg" in svg.read_bytes()[:2000]


@pytest.mark.parametrize("argv, why", [
    (["nosuch", "--ranks", "4", "--count", "8"], "unknown allreduce algorithm 'nosuch'"),
    (["ring", "--ranks", "0", "--count", "8"], "--ranks must be in 1..26"),
    (["ring", "--ranks", "4", "--count", "-1"], "--count must be >= 0"),
    (["ring", "--ranks", "four", "--count", "8"], "expected an integer"),
    (["ring", "--count", "8"], "required: --ranks"),
])
def test_bad_arguments_exit_2_with_usage(argv, why, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: allreduce-explain") and why in err


def test_unavailable_algorithm_says_why(capsys):
    assert main(["mpi", "--ranks", "2", "--count", "2"]) == 1
    assert "cannot explain 'mpi'" in capsys.readouterr().err


def test_console_script_exits_2():
    exe = shutil.which("allreduce-explain")
    cmd = [exe] if exe else [sys.executable, "-m", "allreduce.explain"]
    proc = subprocess.run(cmd + ["ring", "--ranks", "0", "--count", "4"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "usage:" in proc.stderr and "--ranks must be" in proc.stderr


def test_reducescatter_3_ranks():
    # Step s: rank r sends segment (r - s - 1) % p right and adds segment (r - s - 2) % p; rank r ends with r.
    got = _parse(render(explain("ring", 3, 3, collective="reducescatter")))
    assert got["reduce-scatter 0"][0] == {"0 -> 1  chunk 2  a2", "1 -> 2  chunk 0  b0", "2 -> 0  chunk 1  c1"}
    assert got["reduce-scatter 0"][1] == _cells(["a ac a", "b b ab", "bc c c"], ["0", "1", "2"])
    assert got["reduce-scatter 1"][1] == _cells(["abc ac a", "b abc ab", "bc c abc"], ["0", "1", "2"])


def test_binomial_broadcast_4_ranks():
    # Root 0 sends to 2 (mask 2) and 1 (mask 1); 2 forwards to 3. Non-roots start empty ('.').
    text = render(explain("binomial", 4, 2, collective="broadcast"))
    got = _parse(text)
    assert got["start"][1] == [["a0"], ["."], ["."], ["."]]
    assert got["broadcast 0"][0] == {"0 -> 2  chunk 0  a0", "0 -> 1  chunk 0  a0", "2 -> 3  chunk 0  a0"}
    assert got["broadcast 0"][1] == [["a0"]] * 4
    assert "ERROR" not in text


def _forgets_last_rank(comm, buf, op, *, workspace, segment_bytes):
    """A broken allreduce: ranks 0..p-2 swap whole buffers and add them; the last rank is left out."""
    p, rank = comm.size, comm.rank
    comm.mark("exchange", 0)
    if rank == p - 1:
        return
    incoming = workspace.get("x", buf.size, buf.dtype)
    total = buf.copy()
    for peer in range(p - 1):
        if peer != rank:
            comm.sendrecv(buf, peer, incoming, peer)
            total += incoming
    buf[:] = total


def test_missing_contribution_is_flagged():
    text = render(explain(_forgets_last_rank, 3, 2))
    assert "ERROR: rank 0 element 0 ends with a+b, expected a+b+c" in text


def test_lines_format_names_rank_and_chunk(capsys):
    assert main(["ring", "--ranks", "3", "--count", "3", "--format", "lines"]) == 0
    out = capsys.readouterr().out
    after_rs1 = out.split("reduce-scatter 1")[1].split("allgather 0")[0]
    assert "  rank 2 chunk 0: a0+b0+c0\n" in after_rs1 and "  rank 0 chunk 1: a1+b1+c1\n" in after_rs1


@pytest.mark.parametrize("collective, algorithm", [
    ("allreduce", "ring"), ("allreduce", "tree"), ("allreduce", "rhd"), ("allreduce", "rd"),
    ("broadcast", "binomial"), ("broadcast", "scatter-allgather"), ("allgather", "ring"),
    ("reducescatter", "ring")])
def test_sizes_and_rank_counts_explain_cleanly(collective, algorithm):
    """0 and non-divisible counts, p = 1 and odd p, pipelined segments: every run ends as promised."""
    for p in (1, 2, 3, 5):
        for count in (0, 1, 7):
            trace = explain(algorithm, p, count, collective=collective, segment_bytes=8)
            assert trace.errors() == [], (p, count, trace.errors())


def test_hierarchical_crosses_nodes_only_between_equal_local_ranks():
    # Nodes {0, 1} and {2, 3}: shared memory inside a node, one ring per local rank across nodes.
    trace = explain("hierarchical", 4, 4, node_size=2)
    pairs = {(m.src, m.dst) for m in trace.recording.messages}
    assert pairs == {(0, 2), (2, 0), (1, 3), (3, 1)}
    assert trace.errors() == []
