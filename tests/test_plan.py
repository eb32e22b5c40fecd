"""allreduce-plan (allreduce/plan/): the arithmetic against the papers' own numbers.

Pure and fast: no TensorFlow, no MPI. The prediction-vs-measured check of the project's own runs
is tests/test_plan_run.py.
"""
from __future__ import annotations

import math

import pytest

from allreduce.algorithms import network, select
from allreduce.plan import PRECISIONS, PRESETS, Layout, Machine, Params, Transformer, memory, search, zero_bytes
from allreduce.plan.cli import main, parse_size
from allreduce.plan.memory import layer_activation_bytes
from allreduce.plan.search import layouts
from allreduce.plan.time import allreduce_seconds, bubble, step_flops, step_time

MIXED, FP32 = PRECISIONS["mixed"], PRECISIONS["fp32"]
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _builtin_costmodel(tmp_path, monkeypatch):
    """Collectives priced from the package's table, not a per-machine fit."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ALLREDUCE_COSTMODEL", raising=False)
    select.clear_cache()
    yield
    select.clear_cache()


def test_zero_table_exactly():
    """Rajbhandari et al. 2019, Figure 1: 7.5 B parameters, 64 GPUs, mixed-precision Adam (K = 12)."""
    psi, n = 7.5e9, 64
    want = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    printed = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}                          # GB, as the paper prints them
    for stage in range(4):
        got = sum(zero_bytes(psi, MIXED, stage, n))
        assert got == want[stage]
        assert round(got / 1e9, 1) == printed[stage]
        plan = memory(Params(int(psi)), Layout(data=n, zero=stage), MIXED)
        assert plan.total == want[stage] and plan.activations == 0


def test_zero_table_from_the_command(capsys):
    assert main(["--params", "7.5e9", "--devices", "64", "--tensor", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["64", "1"]]
    assert [(r[3], r[10]) for r in rows] == [("0", "120.0"), ("1", "31.4"), ("2", "16.6"), ("3", "1.9")]


def test_parameter_counts_of_the_papers_models():
    assert PRESETS["megatron-8.3b"].params == 72 * (12 * 3072 ** 2 + 13 * 3072) + 51200 * 3072 + 1024 * 3072 + 2 * 3072
    assert round(PRESETS["megatron-8.3b"].params / 1e9, 1) == 8.3          # Shoeybi et al. 2019, Table 1
    assert round(PRESETS["gpt-1t"].params / 1e9) == 1008                   # Narayanan et al. 2021, Table 1


def test_korthikanti_activation_formula():
    """Korthikanti et al. 2022, Table 2 (fp16, dropout): bytes per layer for each variant."""
    m = Transformer(4, 1024, 16, 2048, 1000)
    s, b, h, a = 2048, 3, 1024, 16
    for t in (1, 2, 8):
        def act(recompute, sp=False):
            return layer_activation_bytes(m, Layout(tensor=t, micro_batch=b, recompute=recompute,
                                                    sequence_parallel=sp), MIXED)
        assert act("none") == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert act("none", sp=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
        assert act("selective") == pytest.approx(s * b * h * (10 + 24 / t))
        assert act("selective", sp=True) == pytest.approx(s * b * h * 34 / t)
        assert act("full") == pytest.approx(2 * s * b * h)
        assert act("full", sp=True) == pytest.approx(2 * s * b * h / t)
    # fp32 without dropout: 16 elements of 4 bytes and the scores once
    m32 = Transformer(4, 1024, 16, 2048, 1000, dropout=False)
    assert layer_activation_bytes(m32, Layout(micro_batch=b), FP32) == pytest.approx(s * b * h * (64 + 4 * a * s / h))
    # Keras layers on TF (examples/gpt.py): layernorms keep 2 arrays each, exact GELU 4 f-wide ones
    keras_ = Transformer(4, 1024, 16, 2048, 1000, dropout=False, kept="keras")
    assert layer_activation_bytes(keras_, Layout(micro_batch=b, tensor=2), FP32) == pytest.approx(
        4 * s * b * h * (6 + (4 + 16) / 2) + 4 * a * s * s * b / 2)


def test_megatron_8_3b_needs_tensor_8_on_32gb_v100s():
    """Megatron (2019): no ZeRO, no pipeline, every data rank's 8 sequences in one pass with activation
    checkpointing. Tensor 4 holds 33.3 GB of model states plus activations: over 32 GiB; 8 fits."""
    model = PRESETS["megatron-8.3b"]
    machine = Machine(memory=32 * GIB)
    plans = search(model, 512, MIXED, machine, feasible_only=False, global_batch=512, micro_batch=0,
                   zero=(0,), pipeline=1, recompute=("full",))
    fits = {p.layout.tensor: p.fits for p in plans}
    assert fits == {1: False, 2: False, 4: False, 8: True, 16: True, 32: True}
    t4 = next(p for p in plans if p.layout.tensor == 4)
    assert t4.memory.weights + t4.memory.grads + t4.memory.state == pytest.approx(16 * model.params / 4, rel=1e-9)
    paper = next(p for p in plans if p.layout.tensor == 8)
    assert paper.layout.data == 64 and paper.layout.micro_batch == 8        # 8-way tensor x 64-way data
    # ZeRO, which came after, fits it without tensor parallelism: stage 3 over 512 ranks
    z3 = search(model, 512, MIXED, machine, global_batch=512, micro_batch=1, zero=(3,), tensor=1, pipeline=1,
                recompute=("full",))
    assert z3 and z3[0].memory.total < 32 * GIB


def test_gpt_1t_fits_at_tensor_8_pipeline_64_with_recompute():
    """Narayanan et al. 2021: 1 T on 3072 A100 80 GB as tensor 8 x pipeline 64 x data 6, micro-batch 1."""
    model = PRESETS["gpt-1t"]
    plans = search(model, 3072, MIXED, Machine(memory=80e9), feasible_only=False, global_batch=3072,
                   micro_batch=1, tensor=8, pipeline=64, zero=(0,))
    fits = {p.layout.recompute: p.fits for p in plans}
    assert fits == {"none": False, "selective": False, "full": True}
    full = next(p for p in plans if p.layout.recompute == "full")
    assert full.layout.data == 6 and full.layout.microbatches == 512 and full.memory.stage == 0
    assert full.time.bubble == pytest.approx(63 / 512)


def test_pipeline_stage_0_holds_p_microbatches():
    model = Transformer(8, 64, 4, 16, 100)
    lay = Layout(pipeline=4, microbatches=8, micro_batch=2)
    per_layer = layer_activation_bytes(model, lay, FP32)
    first = memory(model, lay, FP32)
    assert first.stage == 0
    assert first.activations == pytest.approx(2 * 4 * per_layer)            # 2 layers x 4 in flight
    few = memory(model, Layout(pipeline=4, microbatches=2, micro_batch=2), FP32)
    assert few.activations == pytest.approx(2 * 2 * per_layer)              # only 2 micro-batches exist


def test_layouts_cover_the_devices_and_respect_the_shape():
    model = Transformer(12, 96, 6, 32, 100)
    lays = layouts(model, 12, global_batch=24, micro_batch=1)
    assert lays and all(lay.devices == 12 for lay in lays)
    assert all(model.heads % lay.tensor == 0 and model.layers % lay.pipeline == 0 for lay in lays)
    assert all(lay.zero < 2 for lay in lays if lay.pipeline > 1)              # DeepSpeed's pipeline rule
    assert {lay.tensor for lay in lays} == {1, 2, 3, 6}                       # 4 and 12 do not divide 6 heads
    assert all(lay.data * lay.microbatches * lay.micro_batch == 24 for lay in lays)


def test_step_time_uses_the_projects_cost_model():
    model = Transformer(4, 256, 4, 64, 512)
    nbytes = 1 << 20
    assert allreduce_seconds(nbytes, 4, Machine()) == select.ranked(
        nbytes, 4, candidates=("ring", "tree", "rhd", "rd", "mpi", "shm"))[0][1]
    link = network.parse_link("8gbit,10us")
    a, b, _ = select.terms("ring", 4)
    assert allreduce_seconds(nbytes, 4, Machine(intra=link)) == pytest.approx(a * 10e-6 + b * nbytes * 1e-9)
    lay = Layout(data=2, pipeline=2, microbatches=4, micro_batch=2)
    st = step_time(model, lay, FP32, Machine(flops=1e9), stage_params=1000)
    flops = step_flops(model, lay, 16)
    assert st.compute == pytest.approx(flops / 4 / 1e9)
    assert st.bubble == bubble(lay) == pytest.approx(1 / 4)
    assert st.total == pytest.approx(st.compute * 1.25 + st.data + st.tensor + st.pipeline)
    # recompute costs compute: full > selective > none
    costs = [step_flops(model, Layout(recompute=r), 8) for r in ("none", "selective", "full")]
    assert costs[0] < costs[1] < costs[2] and costs[2] < 4 / 3 * costs[0] + 1


def test_explain_and_bad_input(capsys):
    assert main(["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "16", "--vocab", "100",
                 "--devices", "2", "--precision", "fp32", "--explain", "--tensor", "2", "--zero", "0",
                 "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO 0 over d 1: weights 4 B x P" in out and "activations, recompute none" in out
    with pytest.raises(SystemExit, match="does not divide into 3 heads"):
        main(["--layers", "2", "--hidden", "64", "--heads", "3", "--seq", "16", "--vocab", "100", "--devices", "2"])
    with pytest.raises(SystemExit, match="exactly one of"):
        main(["--params", "1e9", "--model", "gpt-1t", "--devices", "2"])
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--devices", "2", "--memory", "lots"])
    assert parse_size("32GiB") == 32 * GIB and parse_size("80GB") == 80e9 and math.isinf(float("inf"))


def test_keras_top_of_model_and_tfops_stage_3():
    """The terms examples/gpt.py's counted runs showed (BENCHMARKS.md, plan_bench): with Keras layers
    the final LayerNorm keeps 3 s b h and the loss 2 fp32 arrays of the logits; tfops' stage 3 is ZeRO 3
    with full recompute: each layer's input, one layer rebuilt less its input, the final norm's and
    head's inputs; plus two gathered layers' weights and one layer's whole gradients."""
    L, h, a, s, v, b, d = 2, 128, 4, 64, 128, 4, 4
    model = Transformer(L, h, a, s, v, dropout=False, tied=False, kept="keras")
    sbh = s * b * h * 4
    per_layer = 26 * sbh + a * s * s * b * 4
    top = 2 * 4 * s * b * v
    plain = memory(model, Layout(data=d, micro_batch=b), FP32)
    assert plain.activations == pytest.approx(L * per_layer + 3 * sbh + top)
    z3 = memory(model, Layout(data=d, zero=3, recompute="full", micro_batch=b), FP32)
    assert z3.activations == pytest.approx(L * sbh + (per_layer - sbh) + 2 * sbh + top)
    P, U = model.params, model.layer_params()
    assert z3.weights == pytest.approx(4 * P / d + 2 * 4 * U)
    assert z3.grads == pytest.approx(4 * P / d + 4 * U)
    # its collectives run a unit at a time: the latency is paid per unit, the bytes once; fully_shard
    # wraps each Keras layer, so L layers + the token and position embeddings, final norm and head
    lay = Layout(data=d, zero=3, recompute="full", micro_batch=b)
    link = Machine(flops=1e9, intra=network.Link(1e-3, 0.0))
    st = step_time(model, lay, FP32, link, stage_params=P)
    assert st.data == pytest.approx(1.5 * (L + 4) * select.terms("ring", d)[0] * 1e-3)
    assert any("x 6 units (2 layers + 4 outside them)" in line for line in st.lines)


def test_host_term_counts_calls_eager_ops_and_updates():
    """A compiled step is one call; a pipeline stage 2m calls, m x T eager gradient sums and T eager
    updates (T: its weight tensors, 16 a Keras layer + the larger edge's); none without host costs."""
    from allreduce.plan.cli import _host
    model = Transformer(4, 64, 4, 32, 128, dropout=False, tied=False, kept="keras")
    machine = Machine(flops=1e9, call=1e-4, eager_op=1e-5, eager_update=1e-3)
    plain = Layout(data=4, tensor=1, pipeline=1, zero=0, recompute="none", micro_batch=2, microbatches=1)
    assert step_time(model, plain, FP32, machine, stage_params=1000).host == pytest.approx(1e-4)
    piped = Layout(data=2, tensor=1, pipeline=2, zero=0, recompute="none", micro_batch=2, microbatches=4)
    tensors = 2 * 16 + 4                                  # 2 layers a stage; the last stage's LN and untied head
    got = step_time(model, piped, FP32, machine, stage_params=1000)
    assert got.host == pytest.approx(8 * 1e-4 + 4 * tensors * 1e-5 + tensors * 1e-3)
    assert any(line.startswith("host: 4 micro-batches") for line in got.lines)
    assert step_time(model, piped, FP32, Machine(flops=1e9), stage_params=1000).host == 0.0
    assert _host("300us,12us,1.8ms") == pytest.approx((3e-4, 1.2e-5, 1.8e-3, 0.0, 0.0))
    assert _host("300us,12us,1.8ms,60us,40us") == pytest.approx((3e-4, 1.2e-5, 1.8e-3, 6e-5, 4e-5))


def test_stage_3_units_and_its_hand_offs_and_exits():
    """ZeRO 3 pays per unit: tfops' fully_shard makes each Keras layer with weights a unit (L layers,
    the token and position embeddings, the final norm, an untied head: examples/gpt.py has 6 at
    L = 2, as benchmarks/plan_bench.py counts in its run); Megatron's count is L + 2. Each unit hands
    3 collectives to the worker thread and leaves the graph twice more, per micro-batch."""
    from allreduce.plan.time import host_counts, zero3_units
    keras_gpt = Transformer(2, 64, 4, 32, 128, dropout=False, tied=False, kept="keras")
    z3 = Layout(data=4, zero=3, recompute="full", micro_batch=2, microbatches=3)
    assert zero3_units(keras_gpt, z3) == 6
    assert zero3_units(Transformer(2, 64, 4, 32, 128, tied=True, kept="keras"), z3) == 5
    assert zero3_units(Transformer(2, 64, 4, 32, 128), z3) == 4
    assert zero3_units(Transformer(6, 64, 4, 32, 128, kept="keras", tied=False),
                       Layout(data=2, pipeline=2, zero=3, recompute="full", microbatches=4)) == 3 + 2
    assert zero3_units(keras_gpt, Layout(data=4, zero=2)) == 1 and zero3_units(Params(1000), z3) == 1
    n = host_counts(keras_gpt, z3)
    assert (n.calls, n.ops, n.updates, n.handoffs, n.exits) == (1, 0, 0, 3 * 3 * 6, 2 * 3 * 6)
    machine = Machine(flops=1e9, call=1e-4, handoff=1e-5, graph_exit=1e-6)
    got = step_time(keras_gpt, z3, FP32, machine, stage_params=1000)
    assert got.host == pytest.approx(1e-4 + 54 * 1e-5 + 36 * 1e-6)
    assert any(line.startswith("host: 1 compiled step, 3 micro-batches x 6 units x (3 hand-offs + 2 exits)")
               for line in got.lines)
    plain = Layout(data=4, zero=0, micro_batch=2, microbatches=3)
    assert step_time(keras_gpt, plain, FP32, machine, stage_params=1000).host == pytest.approx(1e-4)


def test_tensor_allreduces_are_priced_by_the_link_inside_a_step(capsys):
    """Tensor parallelism's allreduces run many in a row inside one compiled step; ``Machine.in_step``
    (measured by benchmarks/plan_bench.py that way) prices them, and only them: the data group's
    exchange, stage 3's units and the pipeline's sends keep ``intra``. Without it, ``intra``."""
    model = Transformer(2, 64, 4, 32, 128, dropout=False, tied=False, kept="keras")
    slow, fast = network.Link(1e-3, 1e-9), network.Link(1e-4, 0.5e-9)
    lay = Layout(data=1, tensor=4, micro_batch=4, microbatches=2)
    act, loss = 32 * 4 * 64 * 4, 4 * 32 * 4                  # s b h fp32; the loss's s b numbers
    a, b, _ = select.terms("ring", 4)

    def ring(link, nbytes):
        return a * link.alpha + b * nbytes * link.beta
    got = step_time(model, lay, FP32, Machine(flops=1e9, intra=slow, in_step=fast), stage_params=1000)
    assert got.tensor == pytest.approx(2 * ((4 * 2 + 2) * ring(fast, act) + 3 * ring(fast, loss)))
    assert any(f"over t 4, in a step: {fast}" in line for line in got.lines)
    plain = step_time(model, lay, FP32, Machine(flops=1e9, intra=slow), stage_params=1000)
    assert plain.tensor == pytest.approx(2 * ((4 * 2 + 2) * ring(slow, act) + 3 * ring(slow, loss)))
    assert got.tensor < plain.tensor / 5
    # the other paths do not take it
    for other in (Layout(data=4, zero=3, recompute="full", micro_batch=4), Layout(data=2, pipeline=2, microbatches=4)):
        with_it = step_time(model, other, FP32, Machine(flops=1e9, intra=slow, in_step=fast), stage_params=1000)
        without = step_time(model, other, FP32, Machine(flops=1e9, intra=slow), stage_params=1000)
        assert (with_it.data, with_it.pipeline, with_it.total) == (without.data, without.pipeline, without.total)
    # the command line: --in-step, shown by --explain on the tensor line
    assert main(["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128", "--devices", "4",
                 "--precision", "fp32", "--tensor", "4", "--zero", "0", "--recompute", "none", "--flops", "1e9",
                 "--intra", "8gbit,1ms", "--in-step", "8gbit,190us", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "in a step: 8 Gbit/s, 190 us per message (configured)" in out
