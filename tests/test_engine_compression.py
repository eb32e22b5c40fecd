"""Compression through the engine: error bounds, pass-through, overflow, error feedback, custom."""
import numpy as np
import pytest

from allreduce.engine import Compression, Compressor
from allreduce.errors import CompressionError
from allreduce.ops import Op, bfloat16

from .engine_util import engines, submit_all, wait_all

# Unit roundoff of each wire format.
_U = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


@pytest.mark.parametrize("comp", ["fp16", "bf16"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_error_bound(comp, p):
    rng = np.random.default_rng(p)
    compressor = getattr(Compression, comp)
    sizes = [0, 1, 5, 100, 1001]
    inputs = {f"x{n}-{dt}": [(rng.standard_normal(n) * 30).astype(dt) for _ in range(p)]
              for n in sizes for dt in (np.float32, np.float64)}
    for op in (Op.AVERAGE, Op.SUM):
        with engines(p) as engs:
            results = wait_all(submit_all(engs, inputs, rng, op=op, compression=compressor))
        for name, xs in inputs.items():
            res = results[name]
            assert all(r.dtype == xs[0].dtype and r.shape == xs[0].shape for r in res)
            assert all(r.tobytes() == res[0].tobytes() for r in res), "ranks differ"
            stack = np.stack([x.astype(np.float64) for x in xs]) if xs[0].size else np.zeros((p, 0))
            want = stack.sum(0) / (p if op == Op.AVERAGE else 1)
            # One rounding per input (cast) and one per addition, each relative to the magnitudes summed.
            bound = (p + 1) * _U[comp] * np.abs(stack).sum(0) / (p if op == Op.AVERAGE else 1)
            assert np.all(np.abs(res[0] - want) <= bound + 1e-30), name


@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_non_float_and_16_bit_inputs_pass_through_exactly(comp):
    inputs = {"i": [np.arange(10, dtype=np.int32) * (r + 1) for r in range(2)],
              "h": [np.full(6, 0.5 + r, np.float16) for r in range(2)],
              "b": [np.full(6, 1.5 + r, bfloat16) for r in range(2)]}
    with engines(2) as engs:
        results = wait_all(submit_all(engs, inputs, op=Op.SUM, compression=getattr(Compression, comp)))
    assert results["i"][0].tolist() == (np.arange(10) * 3).tolist()
    assert results["h"][0].dtype == np.float16 and results["h"][0].tolist() == [2.0] * 6
    assert results["b"][0].dtype == bfloat16 and results["b"][0].astype(np.float32).tolist() == [4.0] * 6


def test_overflow_fails_that_tensor_on_every_rank_and_the_rest_of_the_batch_goes_ahead():
    p = 3
    big = [np.ones(8, np.float32) for _ in range(p)]
    big[1][3] = 1e6                                       # 1e6 / 3 > 65504: fp16 overflows on rank 1
    inputs = {"big": big, "fine": [np.full(5, r, np.float32) for r in range(p)]}
    with engines(p) as engs:
        handles = submit_all(engs, inputs, compression=Compression.fp16)
        messages = []
        for h in handles["big"]:
            with pytest.raises(CompressionError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert all(h.wait(20).tolist() == [1.0] * 5 for h in handles["fine"])
        # Next step with sane values works again.
        ok = wait_all(submit_all(engs, {"big": [np.ones(8, np.float32)] * p}, compression=Compression.fp16))
        assert ok["big"][0].tolist() == [1.0] * 8
    assert len(set(messages)) == 1 and "'big'" in messages[0] and "rank(s) 1 " in messages[0]


def test_overflow_is_agreed_after_a_sum_and_before_a_min_which_could_hide_it():
    """Sum agrees on overflow flags after the reduction (an inf anywhere shows in the sum), Min
    before it: rank 0's 1.0 would hide rank 1's overflowed -inf in the minimum. Both fail on
    every rank naming rank 1, in place too (the input is left as it was), and the batch's other
    tensor is exact."""
    for op, value, when in ((Op.SUM, 1e6, "dropped on every rank"), (Op.MIN, -1e6, "nothing was sent")):
        big = [np.ones(6, np.float32), np.ones(6, np.float32)]
        big[1][2] = value
        keep = [b.copy() for b in big]
        with engines(2) as engs:
            handles = {"big": [e.submit(b, name="big", op=op, compression=Compression.fp16, inplace=True)
                               for e, b in zip(engs, big)],
                       "fine": [e.submit(np.full(3, r + 2.0, np.float32), name="fine", op=op,
                                                  compression=Compression.fp16) for r, e in enumerate(engs)]}
            for h in handles["big"]:
                with pytest.raises(CompressionError, match=f"rank\\(s\\) 1 .*{when}"):
                    h.wait(20)
            fine = [h.wait(20).tolist() for h in handles["fine"]]
        assert fine == [[5.0] * 3] * 2 if op == Op.SUM else fine == [[2.0] * 3] * 2
        assert all(np.array_equal(b, k) for b, k in zip(big, keep))


def test_sum_that_overflows_on_the_wire_is_an_error_but_nan_inputs_pass():
    inputs = {"sum": [np.full(4, 40000.0, np.float32)] * 2,
              "nan": [np.array([np.nan, 1.0], np.float32), np.array([1.0, 1.0], np.float32)]}
    with engines(2) as engs:
        handles = submit_all(engs, inputs, op=Op.SUM, compression=Compression.fp16)
        for h in handles["sum"]:
            with pytest.raises(CompressionError, match="overflowed float16 on the wire"):
                h.wait(20)
        res = handles["nan"][1].wait(20)
    assert np.isnan(res[0]) and res[1] == 2.0


@pytest.mark.parametrize("p", [1, 2])
def test_error_feedback_carries_the_rounding_error_to_the_next_step(p):
    steps = 16
    rng = np.random.default_rng(3)
    xs = [rng.uniform(1, 2, 200).astype(np.float32) for _ in range(p)]
    want = np.mean(np.stack(xs).astype(np.float64), 0)
    errors = {}
    for comp in (Compression.fp16, Compression.fp16.with_error_feedback()):
        total = np.zeros(200)
        with engines(p) as engs:
            for _ in range(steps):
                total += wait_all(submit_all(engs, {"w": xs}, compression=comp))["w"][0]
        errors[comp.name] = np.abs(total / steps - want).max()
    # EF cancels the cast's error over steps (p = 1: the only error); the fp16 sum on the
    # wire still rounds (p = 2), so there it can only help.
    assert errors["fp16+ef"] < errors["fp16"] / (8 if p == 1 else 1.5), errors


class _ToFloat32(Compressor):
    """A user-written compressor: float64 travels as float32."""
    name = "to-float32"

    def compress(self, x):
        return x.astype(np.float32), x.dtype

    def decompress(self, payload, ctx):
        return payload.astype(ctx)


def test_custom_compressor_is_fused_and_decompressed():
    rng = np.random.default_rng(5)
    inputs = {f"c{i}": [rng.standard_normal(10 + i) for _ in range(3)] for i in range(6)}
    with engines(3, fusion_threshold=1 << 20) as engs:
        results = wait_all(submit_all(engs, inputs, rng, compression=_ToFloat32()))
    for name, xs in inputs.items():
        want = np.mean(xs, 0)
        assert results[name][0].dtype == np.float64
        assert np.allclose(results[name][0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("comp", [Compression.fp16, Compression.bf16])
def test_compress_decompress_interface(comp):
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    payload, ctx = comp.compress(x)
    assert payload.dtype == comp.fmt.dtype and payload.shape == x.shape
    back = comp.decompress(payload, ctx)
    assert back.dtype == x.dtype and np.allclose(back, x, rtol=4 * _U[comp.name])
    ints = np.arange(3)
    assert Compression.none.compress(ints)[0] is ints and comp.compress(ints)[0] is ints


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.125])
def test_fast_float32_encode_and_decode_match_the_exact_path(name, scale):
    """float32 input with a power-of-two scale takes the hardware / shift-and-round cast; it must
    give the exact (float64) path's bits and counts, including overflow, inf and NaN."""
    from allreduce.engine.compression import Compression, _decode_checked, _encode_checked
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(50_000), rng.standard_normal(5000) * 1e5,
                        rng.standard_normal(5000) * 1e-6,
                        [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504, 65520, 7e4, 3e38]]).astype(np.float32)
    c = getattr(Compression, name)
    f = c.fmt
    fast, exact = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    counts = c.encode_into(fast, x, scale)
    want = _encode_checked(exact, x, scale, f.mant_bits, f.bias, f.overflow, f.nan_bits)
    assert np.array_equal(fast, exact)
    assert counts == tuple(int(v) for v in want)
    got, ref = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
    assert c.decode_into(got, fast, 1.0) == _decode_checked(ref, fast, 1.0, f.table)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_vectorised_cast_when_every_value_is_finite_matches_numpy_and_counts_nothing(name):
    """All-finite float32 takes the one-pass cast that only ORs an inf/NaN flag (no second pass):
    its bits must be numpy's / ml_dtypes' rounding of x * scale, counts (0, 0), decoded exactly.
    Values that round up to inf, a NaN whose payload would carry into bfloat16's sign, and sizes
    off any vector width must leave that path and still match the exact one."""
    from allreduce.engine.compression import _encode_checked
    c = getattr(Compression, name)
    f, rng = c.fmt, np.random.default_rng(5)
    for n in (0, 1, 7, 33, 10_001):
        x = (rng.standard_normal(n) * rng.choice([1e-7, 1.0, 1e3], n)).astype(np.float32)
        for scale in (1.0, 0.25):
            bits = np.full(n, 0xABCD, np.uint16)
            assert c.encode_into(bits, x, scale) == (0, 0)
            want = (x * np.float32(scale)).astype(f.dtype)
            assert np.array_equal(bits, want.view(np.uint16)), (n, scale)
            back = np.empty(n, np.float32)
            assert c.decode_into(back, bits, 1.0) == 0
            assert np.array_equal(back, want.astype(np.float32))
    edge = np.array([1.0, 65520.0, -7e4, 3.4e38, 2.0], np.float32)      # fp16 rounds the middle to inf
    edge = np.concatenate([edge, np.array([0xFFFF8001, 0x7FFFFFFF], np.uint32).view(np.float32)])
    fast, exact = np.empty(edge.size, np.uint16), np.empty(edge.size, np.uint16)
    got = c.encode_into(fast, edge, 1.0)
    want = _encode_checked(exact, edge, 1.0, f.mant_bits, f.bias, f.overflow, f.nan_bits)
    assert np.array_equal(fast, exact) and got == tuple(int(v) for v in want) and got[1] == 2
    assert c.decode_into(np.empty(edge.size, np.float32), fast, 1.0) == c.count_nonfinite(fast) > 0


def test_in_place_sum_that_overflows_on_the_wire_leaves_the_input_and_a_fine_one_is_decoded_in_place():
    # In place, a result is decoded straight into the caller's array, but only after the 16-bit
    # payload was checked: an overflowed sum must fail and leave the input as it was.
    with engines(2) as engs:
        big = [np.full(4, 40000.0, np.float32) for _ in engs]
        fine = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(2)]
        keep = [b.ctypes.data for b in fine]
        hb = [e.submit(b, name="big", op=Op.SUM, compression=Compression.fp16, inplace=True) for e, b in zip(engs, big)]
        hf = [e.submit(f, name="fine", op=Op.SUM, compression=Compression.fp16, inplace=True) for e, f in zip(engs, fine)]
        for h in hb:
            with pytest.raises(CompressionError, match="overflowed float16 on the wire"):
                h.wait(20)
        results = [h.wait(20) for h in hf]
    assert all(b.tolist() == [40000.0] * 4 for b in big)
    for r, f, res in zip(range(2), fine, results):
        assert res is f and f.ctypes.data == keep[r] and f.tolist() == (np.arange(6) * 3.0).tolist()
