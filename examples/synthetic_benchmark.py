"""Images/sec on synthetic data, as Horovod's tensorflow2_synthetic_benchmark.py prints them.

::

    mpirun -np 2 python examples/synthetic_benchmark.py                  # tfops, DistributedGradientTape
    mpirun -np 2 python examples/synthetic_benchmark.py --mode hooks     # allreduce overlapped with backprop
    mpirun -np 2 python examples/synthetic_benchmark.py --compare-mwms   # + tf.distribute MultiWorkerMirrored
    python examples/synthetic_benchmark.py --scaling 1,2 --compare-mwms  # runs mpirun per np; efficiency table
    mpirun -np 2 python examples/synthetic_benchmark.py --compare-mwms --bound   # + what the step can reach

The default model is a small CNN on 32x32x3 images (about 0.3 M parameters)
so a run takes well under a minute on 2 idle CPU cores. ``--compare-mwms``
trains the same model on the same per-rank batch with
``tf.distribute.MultiWorkerMirroredStrategy`` in the same processes (workers on
localhost ports, ring collectives over gRPC), after the tfops run.
With ``ALLREDUCE_TIMELINE=/tmp/tl.json`` rank 0 also reports, from the engine's
timeline, how many of the last step's allreduces started before backprop
submitted its last gradient: 0 of 10 with ``--mode tape`` (the reduction waits
for backprop), 8 of 10 with ``--mode hooks`` on 2 ranks of a 2-core VM.
``--bound`` times, in the same launch, the step's compute alone, its forward
pass alone and the allreduce of one step's gradients alone (with its CPU time),
and prints the fastest step they allow, max(compute, forward + exchange): no
gradient exists before the forward pass ends, and none is reduced in less time
than the exchange alone takes.
``--scaling`` launches one mpirun per world size and reports scaling
efficiency = img/s at np / (np * img/s at np=1). On one machine the ranks
share its cores, so efficiency there measures overhead, not speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["tape", "hooks", "optimizer"], default="tape",
                        help="DistributedGradientTape, GradientHooks, or DistributedOptimizer.apply")
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression of the gradients")
    parser.add_argument("--num-groups", type=int, default=0,
                        help="--mode tape: reduce in this many grouped calls after backprop (Horovod's num_groups; "
                             "1: one call). Default 0: buckets submitted as backprop produces them (tfops.training.overlap)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--compare-mwms", action="store_true", help="also time MultiWorkerMirroredStrategy")
    parser.add_argument("--local-baseline", action="store_true",
                        help="also time the same step with no gradient exchange at all: every rank trains "
                             "alone, so its efficiency is this machine's ceiling for any data-parallel library")
    parser.add_argument("--bound", action="store_true",
                        help="also time, in this launch, the step's compute alone (as --local-baseline) and the "
                             "allreduce of one step's gradients alone (the engine, same compression), and print "
                             "what they allow: a step takes at least max(compute, forward + exchange)")
    parser.add_argument("--barrier-baseline", action="store_true",
                        help="also time the same step with a barrier where the gradient exchange goes (one "
                             "numpy_function over the gradients that only waits for every rank): what any "
                             "synchronous data-parallel library pays before it moves a byte")
    parser.add_argument("--commit-every", type=int, default=0,
                        help="elastic training (allreduce-run --elastic): commit the model and optimizer "
                             "(tfops.elastic.TensorFlowKerasState) every this many steps, inside the timed loop")
    parser.add_argument("--json", help="write the results here (with --scaling: every world size's)")
    parser.add_argument("--threads", type=int, default=0,
                        help="TF intra- and inter-op threads per rank (0: TF's default, all cores)")
    parser.add_argument("--scaling", help="comma-separated world sizes: launch each and compare")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --scaling: launch the sizes in turn this many times; report medians")
    return parser.parse_args(argv)


def build_model(args):
    import keras
    w = args.width
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((args.image_size, args.image_size, 3)),
        keras.layers.Conv2D(w, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(2 * w, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(4 * w, 3, padding="same", activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1000)])


def time_steps(step, args, say) -> list[float]:
    """Horovod's loop: warmup batches, then num_iters timings of num_batches_per_iter steps each."""
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank")
    return rates


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run(args) -> dict:
    import allreduce as ar
    ar.init()
    size, rank = ar.size(), ar.rank()
    strategy = None
    if args.compare_mwms and size > 1:
        # MultiWorkerMirroredStrategy must exist before TF runs any op, so it comes first.
        # Each worker at its own host's address and a port free there: across the namespace cluster
        # (allreduce-run --cluster) the hostname is the host's address; on one node, localhost.
        here = socket.gethostname() if ar.communicator().nodes > 1 else "localhost"
        workers = ar.allgather_object(f"{here}:{free_ports(1)[0]}")
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                              "task": {"type": "worker", "index": rank}})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    import tfops as hvd
    if args.threads:                               # before TF's context exists (MWMS creates it)
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.compare_mwms and size > 1:
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    def say(text):
        if rank == 0:
            print(text, flush=True)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    shape = (args.batch_size, args.image_size, args.image_size, 3)
    data = tf.constant(np.random.default_rng(rank).random(shape, np.float32))
    target = tf.constant(np.random.default_rng(rank).integers(0, 1000, args.batch_size))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build_model(args)
    optimizer = keras.optimizers.SGD(0.01)
    if args.mode == "optimizer":
        optimizer = hvd.DistributedOptimizer(optimizer, compression=compression)
    optimizer.build(model.trainable_variables)
    hooks = hvd.GradientHooks(model, compression=compression) if args.mode == "hooks" else None

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            if hooks is not None:
                with hooks.forward():
                    loss = loss_fn(target, model(data, training=True))
            else:
                loss = loss_fn(target, model(data, training=True))
        if hooks is not None:
            grads = hooks.wait(tape.gradient(loss, model.trainable_variables))
        elif args.mode == "tape":
            grads = hvd.DistributedGradientTape(tape, compression=compression, num_groups=args.num_groups).gradient(
                loss, model.trainable_variables)
        else:
            grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    hvd.broadcast_variables(model.variables, root_rank=0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    say(f"Model: small CNN, {params / 1e6:.2f} M parameters; batch size {args.batch_size} per rank; "
        f"{size} rank(s); mode {args.mode}{' fp16' if args.fp16_allreduce else ''}")
    timed = step
    if args.commit_every:                          # issue 25: what an elastic job's commits cost
        state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)

        def timed():
            step()
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()
        say(f"Elastic: a commit every {args.commit_every} steps ({ar.communicator().config.elastic and 'under' or 'without'} --elastic)")
    result = {"np": size, "rank": rank, "tfops": summarize(time_steps(timed, args, say), size, "tfops", say)}

    if args.local_baseline or args.bound:
        local_opt = keras.optimizers.SGD(0.01)
        local_opt.build(model.trainable_variables)

        @tf.function
        def local_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(target, model(data, training=True))
            local_opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        say("No gradient exchange (every rank alone), same model and per-rank batch:")
        result["local"] = summarize(time_steps(local_step, args, say), size, "local", say)

    if args.barrier_baseline:
        barrier_opt = keras.optimizers.SGD(0.01)
        barrier_opt.build(model.trainable_variables)

        def wait_for_all(*arrays):                 # the exchange's place in the step, moving nothing
            ar.barrier()
            return list(arrays)

        @tf.function
        def barrier_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(target, model(data, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            synced = tf.numpy_function(wait_for_all, grads, [g.dtype for g in grads], stateful=True)
            for g, s in zip(grads, synced):
                s.set_shape(g.shape)
            barrier_opt.apply(synced, model.trainable_variables)

        say("A barrier instead of the gradient exchange (every rank waits for all, no data moves):")
        result["barrier"] = summarize(time_steps(barrier_step, args, say), size, "barrier", say)

    if strategy is not None:
        with strategy.scope():
            mw_model, mw_opt = build_model(args), keras.optimizers.SGD(0.01)

        @tf.function
        def mw_step():
            def replica_step():
                with tf.GradientTape() as tape:
                    loss = loss_fn(target, mw_model(data, training=True)) / size
                mw_opt.apply(tape.gradient(loss, mw_model.trainable_variables), mw_model.trainable_variables)
            strategy.run(replica_step)

        say("MultiWorkerMirroredStrategy, same model and per-rank batch:")
        result["mwms"] = summarize(time_steps(mw_step, args, say), size, "MWMS", say)
    if args.bound and size > 1:
        @tf.function
        def forward():
            return loss_fn(target, model(data, training=True))

        say("The forward pass alone (loss only), same model and per-rank batch:")
        result["forward"] = summarize(time_steps(forward, args, say), size, "forward", say)
        result["bound"] = exchange_bound(args, model, compression, result, say)
    timeline = ar.communicator().config.timeline
    ar.shutdown()                                  # closes the timeline file
    if timeline and rank == 0:
        say(overlap_report(timeline, f"{args.mode}.grad."))
    return result


def exchange_bound(args, model, compression, result: dict, say) -> dict:
    """The allreduce of one step's gradients alone (through the engine, as the tape's buckets go,
    same compression), timed in this launch, against the step's compute alone (``result["local"]``)
    and its forward pass alone (``result["forward"]``). A synchronous data-parallel step takes at
    least its compute, and at least the forward pass plus the exchange: no gradient exists before
    the forward pass ends (the best case hides all of backprop behind the exchange). With none of
    it overlapped, the step is compute plus exchange. Returns the figures; prints them, and where
    MWMS ran, the ratio to it that the best step would reach."""
    import allreduce as ar
    import numpy as np
    grads = [np.full(v.shape, 0.5, np.float32) for v in model.trainable_variables]
    nbytes = sum(g.nbytes for g in grads)
    for _ in range(args.num_warmup_batches):
        ar.grouped_allreduce(grads, name="bound.grads", compression=compression)
    times, cpu = [], []
    for _ in range(args.num_iters):
        ar.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(args.num_batches_per_iter):
            ar.grouped_allreduce(grads, name="bound.grads", compression=compression)
        times.append((time.perf_counter() - start) / args.num_batches_per_iter)
        cpu.append((time.process_time() - start_cpu) / args.num_batches_per_iter)
    slowest = ar.allgather_object((float(np.median(times)), float(np.median(cpu))))
    exchange, exchange_cpu = max(t for t, _ in slowest), max(c for _, c in slowest)
    compute = args.batch_size / result["local"]["per_rank"]
    forward = args.batch_size / result["forward"]["per_rank"]
    best = args.batch_size / max(compute, forward + exchange)
    serial = args.batch_size / (exchange + compute)
    bound = {"compute_ms": compute * 1e3, "forward_ms": forward * 1e3, "exchange_ms": exchange * 1e3,
             "exchange_cpu_ms": exchange_cpu * 1e3, "gradient_bytes": nbytes, "best_per_rank": best,
             "serial_per_rank": serial}
    say(f"Bound: compute alone {compute * 1e3:.2f} ms a step, its forward pass {forward * 1e3:.2f} ms; the allreduce "
        f"of one step's gradients alone ({nbytes / 1e6:.2f} MB{', fp16 on the wire' if args.fp16_allreduce else ''}) "
        f"{exchange * 1e3:.2f} ms ({exchange_cpu * 1e3:.2f} ms of CPU time, polls included). A synchronous step takes "
        f"at least max(compute, forward + exchange): at best {best:.1f} img/sec per rank, {serial:.1f} with nothing "
        f"overlapped; tfops ran {result['tfops']['per_rank']:.1f} ({result['tfops']['per_rank'] / best:.0%} of the best)")
    if "mwms" in result:
        mwms = result["mwms"]["per_rank"]
        bound["best_over_mwms"] = best / mwms
        say(f"Bound: MultiWorkerMirroredStrategy ran {mwms:.1f} img/sec per rank ({mwms / best:.0%} of the best "
            f"step), so no synchronous step could run more than {best / mwms:.2f}x it here; tfops ran "
            f"{result['tfops']['per_rank'] / mwms:.2f}x")
    return bound


def overlap_report(path: str, prefix: str) -> str:
    """From the engine's timeline (ALLREDUCE_TIMELINE): did the last step's allreduces overlap backprop?"""
    events = [json.loads(line.rstrip().rstrip(",")) for line in open(path) if line.startswith("{")]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans: dict[str, dict[str, list[float]]] = {}
    for e in events:
        if e.get("ph") == "X" and names.get(e.get("tid"), "").startswith(prefix):
            spans.setdefault(e["name"], {}).setdefault(names[e["tid"]], []).append(e["ts"])
    queued, reduced = spans.get("QUEUE", {}), spans.get("ALLREDUCE", {})
    if not queued or not reduced:
        return f"timeline {path}: no {prefix}* tensors"
    step = min(len(t) for t in queued.values()) - 1
    submits = [t[step] for t in queued.values()]
    starts = [t[step] for t in reduced.values() if len(t) > step]
    early = sum(s < max(submits) for s in starts)
    return (f"timeline {path}, last step: {len(submits)} gradients submitted within "
            f"{(max(submits) - min(submits)) / 1e3:.1f} ms; {early} of {len(starts)} allreduces started before "
            f"the last submission (overlapping backprop)")


def summarize(rates, size, label, say) -> dict:
    import numpy as np
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    say(f"{label}: img/sec per rank: {mean:.1f} +-{conf:.1f}")
    say(f"{label}: total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
    return {"per_rank": mean, "total": size * mean, "conf": conf}


def scaling(args, argv) -> None:
    """Run this script under our launcher for each world size and print the efficiency table.

    With ``--rounds R`` the world sizes are launched in turn R times (1, 2, 1, 2, ...) and every
    figure is the median over the rounds: on a shared VM one launch can run 10-20% faster or
    slower than the next, and alternating keeps a slow spell from landing on one size only."""
    sizes = [int(n) for n in args.scaling.split(",")]
    skip = {"--scaling", "--json", "--rounds"}
    child = [a for i, a in enumerate(argv) if a not in skip and (i == 0 or argv[i - 1] not in skip)]
    launches: dict[int, list[dict]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in sizes:
                out = os.path.join(tmp, f"np{n}.{r}.json")
                # allreduce-run: root, oversubscription and binding as a user gets them (bound to
                # cores while the ranks fit, as Open MPI does by default; unbound beyond that).
                cmd = [sys.executable, "-m", "allreduce.run", "-np", str(n),
                       sys.executable, os.path.abspath(__file__), *child, "--json", out]
                print(f"$ allreduce-run -np {n} python {os.path.basename(__file__)} {' '.join(child)}"
                      + (f"   # round {r + 1} of {args.rounds}" if args.rounds > 1 else ""), flush=True)
                subprocess.run(cmd, check=True)
                with open(out) as f:
                    launches[n].append(json.load(f))
    rows = {n: _median_launch(launches[n]) for n in sizes}
    if args.rounds > 1:
        print("\nper round (total img/s): " + "; ".join(
            f"np {n}: " + ", ".join(f"{x:.0f}" for x in rows[n]["tfops"]["rounds"]) for n in sizes))
    base = rows[sizes[0]]["tfops"]["total"] / sizes[0]
    local_base = rows[sizes[0]]["local"]["total"] / sizes[0] if "local" in rows[sizes[0]] else None
    barrier_base = rows[sizes[0]]["barrier"]["total"] / sizes[0] if "barrier" in rows[sizes[0]] else None
    print(f"\n{'np':>3} {'tfops img/s':>12} {'efficiency':>10} {'MWMS img/s':>11} {'efficiency':>10}"
          + (f" {'alone img/s':>12} {'efficiency':>10}" if local_base else "")
          + (f" {'barrier img/s':>13} {'efficiency':>10}" if barrier_base else ""))
    for n in sizes:
        line = f"{n:>3} {rows[n]['tfops']['total']:>12.1f} {rows[n]['tfops']['total'] / (n * base):>10.0%}"
        if "mwms" in rows[n]:
            line += f" {rows[n]['mwms']['total']:>11.1f} {rows[n]['mwms']['total'] / (n * base):>10.0%}"
        elif local_base:
            line += f" {'-':>11} {'-':>10}"
        if local_base and "local" in rows[n]:
            line += f" {rows[n]['local']['total']:>12.1f} {rows[n]['local']['total'] / (n * local_base):>10.0%}"
        elif local_base:
            line += f" {'-':>12} {'-':>10}"
        if barrier_base and "barrier" in rows[n]:
            line += f" {rows[n]['barrier']['total']:>13.1f} {rows[n]['barrier']['total'] / (n * base):>10.0%}"
        print(line)
    if local_base:
        print("(alone = the same step with no gradient exchange, each rank on its own: the efficiency "
              "ceiling of this machine for any data-parallel library)")
    if barrier_base:
        print("(barrier = the same step with a barrier where the exchange goes, against the same tfops "
              "baseline: what synchronising the ranks costs before any data moves)")
    if args.rounds > 1:
        print(f"(every figure: the median of {args.rounds} rounds of launches, the sizes alternating)")
    print(f"(efficiency = total img/s / (np * img/s of tfops at np={sizes[0]}); "
          f"command: python {os.path.relpath(__file__)} {' '.join(argv)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "sizes": sizes, "runs": {str(n): rows[n] for n in sizes}}, f, indent=1)


def _median_launch(runs: list[dict]) -> dict:
    """One world size's launches as one record: each method's figures are the medians over them."""
    import numpy as np
    row = dict(runs[0])
    for key in ("tfops", "local", "barrier", "mwms"):
        if all(key in r for r in runs):
            row[key] = {field: float(np.median([r[key][field] for r in runs])) for field in runs[0][key]}
            row[key]["rounds"] = [r[key]["total"] for r in runs]
    return row


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.scaling:
        scaling(args, argv)
        return
    result = run(args)
    if args.json and result["rank"] == 0:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
