"""explain_choice: every modelled algorithm appears once, fastest first, with auto's pick marked."""
from allreduce.algorithms import select
from allreduce.algorithms.explain_choice import explain_choice, predictions


def test_one_node_lists_shm_and_marks_auto():
    text = explain_choice(64 << 20, 4)
    rows = [line.split()[0] for line in text.splitlines()[3:]]
    assert sorted(rows) == sorted({*select.DEFAULTS, "shm", "hierarchical"})
    times = [float(line.split()[1]) for line in text.splitlines()[3:]]
    assert times == sorted(times)
    marked = [line.split()[0] for line in text.splitlines() if line.endswith("<- auto")]
    assert marked == [select.choose(64 << 20, 4)]


def test_many_nodes_drop_shm_and_hierarchical_sends_less():
    table = predictions(1 << 30, 8, local_size=4)
    assert "shm" not in table
    assert table["hierarchical"][0] > 0 and "2 node(s) of 4" in table["hierarchical"][1]
