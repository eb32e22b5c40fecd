"""auto across nodes (allreduce/algorithms/network.py): the link's constants and what each algorithm
sends through a host's link. Pure functions; the probe and the choice on real nodes run under the
namespace cluster (tests/test_cluster.py, tests/mpi/cluster_check.py)."""
import pytest

from allreduce.algorithms import network
from allreduce.auto import AutoChooser


def test_parse_link():
    link = network.parse_link("10gbit")
    assert link.beta == pytest.approx(8 / 10e9) and link.alpha == pytest.approx(25e-6)
    link = network.parse_link("0.96gbit,31us")
    assert link.beta == pytest.approx(8 / 0.96e9) and link.alpha == pytest.approx(31e-6)
    assert network.parse_link("500mbit,2ms").alpha == pytest.approx(2e-3)
    for bad in ("", "fast", "10gb", "0gbit", "1gbit,soon", "1gbit,31"):
        with pytest.raises(ValueError, match="ALLREDUCE_LINK"):
            network.parse_link(bad)


def test_bytes_through_a_hosts_link():
    # 2 hosts x 2 ranks: hierarchical sends each byte across once, a flat ring 1.5 times (the
    # issue's cap of 1.5x), rhd's two crossing steps n/2 from each of 2 ranks, twice.
    b = {name: network.cross_terms(name, 4, 2, 1 << 20)[1] for name in network.NET_ALGORITHMS}
    assert b["hierarchical"] == 1.0 and b["ring"] == b["mpi"] == 1.5 and b["rhd"] == 2.0 and b["rd"] == 2.0
    # 3 hosts x 2 ranks: hierarchical 2(H-1)/H = 4/3, ring 2(p-1)/p = 5/3
    assert network.cross_terms("hierarchical", 6, 3)[1] == pytest.approx(4 / 3)
    assert network.cross_terms("ring", 6, 3)[1] == pytest.approx(5 / 3)
    assert network.cross_terms("ring", 4, 1) == (0.0, 0.0)                      # one node: no network
    with pytest.raises(ValueError, match="shm"):
        network.cross_terms("shm", 4, 2)


def test_ranking_follows_the_link():
    slow, fast = network.parse_link("1gbit,30us"), network.parse_link("100gbit,2us")
    top = network.ranked(16 << 20, 4, 2, slow)
    assert top[0][0] == "hierarchical" and [t for _, t in top] == sorted(t for _, t in top)
    hier, ring = dict(top)["hierarchical"], dict(top)["ring"]
    assert 1.3 < ring / hier <= 1.5            # the link term dominates: close to the 1.5x cap
    # The faster the link, the less the network term weighs.
    assert dict(network.ranked(16 << 20, 4, 2, fast))["ring"] < ring


class _Chooser(AutoChooser):
    """AutoChooser's candidate list without a communicator: an MPI transport on ``nodes`` hosts."""

    def __init__(self, size, local_size, nodes, link):
        self.transport = type("T", (), {"comm": object(), "nodes": nodes, "link": link})()
        self.size, self.local_size, self._mpi_transport, self._candidates = size, local_size, True, None


def test_candidates_on_real_nodes():
    link = network.parse_link("1gbit")
    assert "hierarchical" in _Chooser(4, 2, 2, link).auto_candidates
    assert "shm" not in _Chooser(4, 2, 2, link).auto_candidates
    assert "hierarchical" not in _Chooser(2, 1, 2, link).auto_candidates      # one rank a host: it is a ring
    one_node = _Chooser(4, 4, 1, None).auto_candidates                         # unchanged on one node
    assert one_node == ("ring", "tree", "rhd", "rd", "mpi", "shm")
    assert "hierarchical" not in _Chooser(4, 2, 1, None).auto_candidates        # fake nodes: unchanged


def test_explain_choice_across_nodes():
    from allreduce.algorithms.explain_choice import explain_choice
    text = explain_choice(16 << 20, 4, local_size=2, nodes=2, link=network.parse_link("1gbit"),
                          candidates=("ring", "tree", "rhd", "rd", "mpi", "hierarchical"))
    lines = text.splitlines()
    assert "across 2 nodes" in lines[0] and lines[2].split()[0] == "hierarchical" and "<- auto" in lines[2]
    assert text.count("<- auto") == 1 and len(lines) == 8


def test_across_nodes_the_model_pick_stands_unless_beaten_by_the_margin():
    from allreduce.auto import NET_MARGIN
    from allreduce.autotune import AutoTuner, Trial
    chooser = _Chooser(4, 2, 2, network.parse_link("1gbit"))
    chooser.tuner = AutoTuner()
    trial = Trial(16 << 20, ["hierarchical", "mpi", "ring"], 6)
    chooser.tuner.decided[trial.nbytes] = {"hierarchical": 0.1807, "mpi": 0.1729, "ring": 0.243}
    assert chooser._model_unless_beaten(trial, "mpi") == "hierarchical"         # 4.5% apart: noise
    chooser.tuner.decided[trial.nbytes]["mpi"] = 0.1807 / NET_MARGIN / 1.01
    assert chooser._model_unless_beaten(trial, "mpi") == "mpi"                  # clearly faster: measured wins
