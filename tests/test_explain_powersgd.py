"""allreduce-explain powersgd: the recorded steps obey PowerSGD's algebra, and the printout says so."""
import numpy as np
import pytest

from allreduce.explain.__main__ import main
from allreduce.explain.powersgd import run


def test_recorded_steps_are_the_algorithm():
    p, rows, cols = 3, 5, 4
    matrices, hook, results = run(p, rows, cols, rank=2)
    (p_out, q_out) = (results[0][0][0][0][1], results[0][0][0][1][1])
    p_ins = [res[0][0][0][0].reshape(rows, 2) for res in results]
    q0 = hook._initial_q("layer/w", cols, 2, np.float64, 0)
    for i, res in enumerate(results):
        np.testing.assert_allclose(p_ins[i], matrices[i] @ q0)                     # P_i = M_i Q
        assert res[0][0][0][1].tobytes() == p_out.tobytes()                          # same P everywhere
        assert res[1][0].tobytes() == results[0][1][0].tobytes()                     # same output
    np.testing.assert_allclose(p_out.reshape(rows, 2), np.mean(p_ins, axis=0))      # allreduce 1: mean
    ortho, _ = np.linalg.qr(p_out.reshape(rows, 2))
    for i, res in enumerate(results):                                                # Q_i = M_i^T P
        q_i = res[0][0][1][0].reshape(2, cols).T                                    # sent as Q^T
        np.testing.assert_allclose(np.abs(q_i), np.abs(matrices[i].T @ ortho), atol=1e-9)
    out = results[0][1][0]
    np.testing.assert_allclose(np.abs(out), np.abs(ortho @ ortho.T @ np.mean(matrices, axis=0)), atol=1e-9)
    for i, res in enumerate(results):                                                # error feedback
        np.testing.assert_allclose(res[2].reshape(rows, cols), matrices[i] - out)


def test_printout_full_rank_is_exact_and_error_feedback_shrinks_the_mean_error(capsys):
    assert main(["powersgd", "--ranks", "2", "--rows", "4", "--cols", "3", "--rank", "3"]) == 0
    text = capsys.readouterr().out
    for part in ("M_i", "P_i = M_i Q", "allreduce 1 (Average) of every P", "P orthonormalised",
                 "Q_i = M_i^T P", "allreduce 2 (Average) of every Q", "approximation P Q^T", "error"):
        assert part in text, part
    assert "|error| / |average| = 0.000" in text
    assert main(["powersgd", "--ranks", "3", "--rows", "6", "--cols", "5", "--rank", "1", "--steps", "40"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[-40:]]
    assert float(rows[-1][2]) < float(rows[0][2]) / 4, (rows[0], rows[-1])


def test_bad_arguments_exit_2():
    for argv in (["powersgd", "--rank", "0"], ["powersgd", "--rows", "99"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
