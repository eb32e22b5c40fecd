"""Follow one step's gradients from ``grad_reduce.reduce_step`` to the engine: the tfops files entered, in order.

    allreduce-run -np 2 python docs/examples/gradient_trip.py

A profiler hook records every call into tfops/ until the first call that hands data to the
engine (``allreduce_async``, ``grouped_allreduce[_async]``, ``synchronize``); consecutive calls
in one file are one stay. Eagerly, and while a ``tf.function`` is traced (the graph path:
tfops.training.overlap's buckets). docs/architecture.md shows the run before and after issue 41.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfops  # noqa: E402

try:
    from tfops.training import grad_reduce
except ImportError:                  # the flat layout before issue 41
    from tfops import grad_reduce

ROOT = os.path.dirname(tfops.__file__) + os.sep
ENGINE_CALLS = {"allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "synchronize"}
trail: list[tuple[str, str]] = []     # (file under tfops/ or "ENGINE", function), one per call


def _record(frame, event, arg):
    if event != "call":
        return
    path, name = frame.f_code.co_filename, frame.f_code.co_name
    if path.startswith(ROOT):
        trail.append((path[len(ROOT):], name))
    elif "/allreduce/" in path and name in ENGINE_CALLS:
        trail.append(("ENGINE", name))


def follow(run) -> list[tuple[str, list[str]]]:
    """The stays (file, functions called there) from the start of ``run`` to the engine."""
    trail.clear()
    sys.setprofile(_record)
    run()
    sys.setprofile(None)
    stays: list[tuple[str, list[str]]] = []
    for path, name in trail:
        if path == "ENGINE":
            break
        if stays and stays[-1][0] == path:
            stays[-1][1].append(name)
        else:
            stays.append((path, [name]))
    return stays


def main():
    tfops.init()
    variables = [tf.Variable(tf.ones([3, 2])), tf.Variable(tf.ones([5]))]
    grads = [tf.ones([3, 2]), tf.ones([5])]
    settings = grad_reduce.GradientSettings().check("trip")

    def eager():
        return grad_reduce.reduce_step(list(grads), variables, settings, "optimizer")

    def traced():
        return tf.function(eager, autograph=False).get_concrete_function()
    for what, run in (("eager", eager), ("tf.function (trace)", traced)):
        run()                           # first calls import and cache: not part of the trip
        stays = follow(run)
        files = {path for path, _ in stays}
        ops = sum(path.endswith("ops.py") for path, _ in stays)
        if tfops.rank() == 0:
            print(f"{what}: {len(stays)} stays in {len(files)} files, ops.py entered {ops} times")
            print("   " + " -> ".join(f"{path}({','.join(dict.fromkeys(names))})" for path, names in stays))
    tfops.shutdown()


if __name__ == "__main__":
    main()
