"""benchmarks/tensor_overlap_bench.py's reading of a profiler trace, on hand-made ops (no TensorFlow)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import tensor_overlap_bench as bench  # noqa: E402


def op(name, kind, start, end, thread):
    return (name, kind, float(start), float(end), thread)


def test_only_the_backward_allreduces_count_and_only_other_threads_matmuls_cover_them():
    ops = [
        op("gpt_1/block_1/row_parallel_dense_1/tfops_tensor_allreduce", "PyFunc", 0, 10, "a"),   # forward g
        op("tfops_tensor_allreduce", "PyFunc", 10, 12, "a"),                                     # the loss's, forward
        op("gradient_tape/gpt_1/block_1/MatMul", "_MklMatMul", 20, 30, "a"),                     # backward starts
        op("tfops_tensor_allreduce_3", "PyFunc", 30, 50, "a"),                                   # f's backward
        op("gradient_tape/gpt_1/block_1/MatMul_1", "_MklMatMul", 35, 45, "b"),                   # dW beside it: 10 us
        op("gradient_tape/gpt_1/block_1/MatMul_2", "_MklMatMul", 40, 48, "b"),                   # overlaps the first: +3
        op("gradient_tape/gpt_1/x/Mul", "Mul", 30, 50, "b"),                                     # not a matmul
        op("gradient_tape/gpt_1/y/MatMul", "_MklMatMul", 30, 50, "a"),                           # same thread: not beside
        op("gpt_1/block_1/next_step_forward", "MatMul", 60, 61, "a"),                            # the next step
        op("tfops_tensor_allreduce", "PyFunc", 61, 70, "a"),                                     # its loss: forward again
    ]
    got = bench.overlap(ops)
    assert got == {"reduces": 1, "reduce_us": 20.0, "overlapped_us": 13.0}


def test_no_backward_allreduce_is_zero_not_an_error():
    assert bench.overlap([op("gpt_1/a", "MatMul", 0, 1, "a")]) == {"reduces": 0, "reduce_us": 0.0, "overlapped_us": 0.0}
