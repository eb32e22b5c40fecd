"""tfops with communication hooks (issue 32): comm_hook= on the tape, the optimizer and GradientHooks.

In this process: the names tfops exports, and bad values refused when the tape or optimizer is
made (TypeError naming the value; ValueError for settings a hook cannot combine with). At
-np 2, tests/mpi/tf_comm_hooks.py (its docstring lists the checks: model.fit, custom loop
inside tf.function, eager, GradientHooks, buckets, and the digits accuracy) runs in
tests/test_tf_rank_scripts.py's launch.
"""
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import allreduce as ar  # noqa: E402
import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402


def test_hooks_are_the_engines_objects():
    assert tfops.PowerSGD is ar.PowerSGD and tfops.OneBit is ar.OneBit and tfops.CommHook is ar.CommHook
    assert hvd.PowerSGD is ar.PowerSGD and hvd.OneBit is ar.OneBit
    opt = tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), comm_hook=tfops.OneBit())
    assert isinstance(opt.comm_hook, ar.OneBit)


@pytest.mark.parametrize("bad, hint", [("powersgd", "a name"), (ar.PowerSGD, "a class"), (3, "int")])
@pytest.mark.parametrize("make", ["tape", "optimizer", "keras optimizer", "hooks"])
def test_a_bad_comm_hook_is_a_type_error_naming_it(make, bad, hint):
    with pytest.raises(TypeError, match="comm_hook must be an allreduce communication hook") as info:
        if make == "tape":
            tfops.DistributedGradientTape(tf.GradientTape(), comm_hook=bad)
        elif make == "optimizer":
            tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), comm_hook=bad)
        elif make == "keras optimizer":
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), comm_hook=bad)
        else:
            tfops.GradientHooks(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), comm_hook=bad)
    assert repr(bad) in str(info.value) and hint in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"compression": tfops.Compression.fp16}, "not both"),
    ({"op": tfops.Adasum}, "Adasum"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"process_set": tfops.ProcessSet([0])}, "process_set"),
])
def test_settings_a_hook_cannot_combine_with_are_refused(kwargs, words):
    for make in (lambda: tfops.DistributedGradientTape(tf.GradientTape(), comm_hook=ar.PowerSGD(), **kwargs),
                 lambda: tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), comm_hook=ar.PowerSGD(), **kwargs)):
        with pytest.raises(ValueError, match=words):
            make()


def test_hooks_and_comm_hook_on_the_optimizer_is_refused():
    hooks = tfops.GradientHooks(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    with pytest.raises(ValueError, match="GradientHooks"):
        tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), hooks=hooks, comm_hook=ar.OneBit())
