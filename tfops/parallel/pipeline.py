"""``tfops.parallel.Pipeline``: train a model cut by layers across the pipeline ranks.

::

    mesh = Mesh(pipeline=4)                                # world 4: one stage a rank
    stage = build_my_layers(mesh.pipeline_rank)            # a keras.Model (interleaved: a list of v)
    pipe = Pipeline(stage, mesh, micro_batches=8, schedule="1f1b", loss=keras.losses.mean_squared_error)
    for x, y in batches:                                   # every rank passes the same global batch
        loss = pipe.train_step(x, y, optimizer)            # the batch's mean loss, on every rank

Steps of :meth:`Pipeline.train_step`:

1. Cut the batch into ``m`` micro-batches (the batch must divide by ``m``).
2. The first time a micro-batch size is seen, agree every chunk boundary's shape and dtype
   (:meth:`_agree`): rank by rank along the model, each chunk runs once on zeros of the
   spec it received and sends its output spec on; the last chunk also runs the loss. Every rank
   then sees every problem found, so a wrong shape or dtype raises ``MismatchError`` on every rank.
3. Run this rank's actions, :func:`allreduce.schedules.stage_actions`, the same lists that
   ``allreduce-explain pipeline`` prints: ``F`` runs the chunk under a ``GradientTape`` (kept until
   ``B``: those are the live activations), ``B`` takes the gradient of the output against the
   received gradient (the last chunk: of ``loss / m``, so that summing the micro-batches gives
   the full batch's gradient of the mean loss), sends and receives go through :mod:`.p2p`.
4. Average the summed gradients over ``mesh.data_set`` (data parallelism; skipped at data = 1),
   apply the optimizer to this rank's chunks, and hand the last stage's loss to every rank.

The forward and backward of every micro-batch appear on the timeline (``ALLREDUCE_TIMELINE`` or
``tfops.start_timeline``) as FORWARD / BACKWARD spans on the rows ``pipeline chunk c`` (the
whole schedule as a SCHEDULE span on the row ``pipeline``), and in :attr:`Pipeline.events` for
the last step; :attr:`Pipeline.peak_live` counts the most forward tapes (activations) alive at once.

Cost per step and rank: ``m v`` forwards and backwards of a chunk, ``2 m v`` messages each way at
most, and the bubble ``(p-1)/(v m)`` of the compute (allreduce/schedules/grid.py).
"""
from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from allreduce import api as _api
from allreduce.schedules.pipeline import check_arguments, model_chunk, stage_actions

from .errors import MismatchError
from .p2p import BAD_SPEC, P2P, act_tag, grad_tag

__all__ = ["Pipeline"]

AHEAD = 4          # actions looked ahead for receives to post: about the next two computes' inputs


def _spec(t) -> tuple[int, tuple[int, ...]]:
    return (tf.as_dtype(t.dtype).as_datatype_enum, tuple(int(d) for d in t.shape))


def _describe(spec) -> str:
    return "nothing (the stage before failed)" if spec == BAD_SPEC else \
        f"shape {spec[1]} dtype {tf.as_dtype(spec[0]).name}"


class Pipeline:
    """Runs one pipeline rank's share of a pipeline-parallel training step.

    Args:
        stage: this rank's ``keras.Model``; for ``schedule="interleaved"``, a list of ``v >= 2``
            models, where entry ``c`` is model chunk ``c * p + pipeline_rank``.
        mesh: the :class:`~tfops.parallel.Mesh`; its ``pipeline_set`` holds the stages.
        micro_batches: ``m``, the micro-batches each global batch is cut into.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (needs p >= 2, m a multiple of p).
        loss: ``loss(y_true, y_pred)`` or a Keras loss name (``"mse"``), averaged over its
            elements; every rank passes the same one, the last stage uses it.
        compiled: run each chunk's forward as a ``tf.function`` (traced once per micro-batch
            shape; the tape records it as one op, so its backward is compiled too). Eager,
            a GPT stage of 4 blocks spent most of its step dispatching ops one by one
            (benchmarks/pipeline_cluster_bench.py); ``False`` runs it eagerly, for debugging.
    """

    def __init__(self, stage, mesh, micro_batches: int, schedule: str = "1f1b", loss=None, *,
                 compiled: bool = True):
        self.chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.mesh, self.m, self.schedule = mesh, micro_batches, schedule
        self.p, self.rank, self.v = mesh.pipeline, mesh.pipeline_rank, len(self.chunks)
        self._forward = [tf.function(self._chunk_call(ch, watch=self._k(c) > 0), reduce_retracing=True)
                         if compiled else self._chunk_call(ch, watch=False) for c, ch in enumerate(self.chunks)]
        check_arguments(schedule, self.p, micro_batches, self.v)
        if isinstance(loss, str):
            import keras
            loss = keras.losses.get(loss)                  # "mse" -> keras.losses.mean_squared_error
        if loss is None or not callable(loss):
            raise MismatchError(f"Pipeline: loss must be a callable loss(y_true, y_pred) on every rank, got {loss!r}")
        self.loss = loss
        self.actions = stage_actions(schedule, self.p, micro_batches, self.rank, self.v)
        self.p2p = P2P(mesh.pipeline_set) if self.p > 1 else None
        self.last = self.p * self.v - 1
        self._specs: dict[int, dict] = {}      # micro-batch size -> {(kind, chunk): spec}
        self.events: list[tuple[str, int, int, float, float]] = []   # (F/B/recv, mb, chunk, start, end)
        self.schedule_span = (0.0, 0.0)        # the last step's schedule, (start, end) in time.monotonic()
        self.peak_live = 0                     # the last step's most (micro-batch, chunk) tapes alive

    @property
    def trainable_variables(self) -> list:
        return [w for chunk in self.chunks for w in chunk.trainable_variables]

    def _k(self, c: int) -> int:
        return model_chunk(self.rank, c, self.p)

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, x, y, optimizer) -> tf.Tensor:
        """One global batch through the schedule; returns its mean loss (a float32 scalar) on every rank.

        Every rank passes the same batch; the first stage reads ``x``, the last ``y``, the others
        only its length. ``optimizer`` is applied to this rank's chunks.
        """
        xs, ys, b = self._split(x, y)
        specs = self._agree(b, xs[0], ys[0])
        saved, received, grads = {}, {}, [None] * len(self.trainable_variables)
        total = tf.constant(0.0, tf.float32)
        self.events, self.peak_live = [], 0
        tl = self._timeline()
        begin = time.monotonic()
        posted = {}                                # action index -> its receive, posted ahead
        for j, a in enumerate(self.actions):
            self._post_ahead(j, specs, posted)
            i, c, k = a.micro_batch, a.chunk, self._k(a.chunk)
            t0 = time.monotonic()
            if a.kind == "recv_act":
                received[(i, c)] = tf.constant(self.p2p.wait(posted.pop(j)))
            elif a.kind == "recv_grad":
                received[("g", i, c)] = tf.constant(self.p2p.wait(posted.pop(j)))
            elif a.kind == "F":
                inp = xs[i] if k == 0 else received.pop((i, c))
                with tf.GradientTape() as tape:
                    if k > 0:
                        tape.watch(inp)
                    out = self._forward[c](inp)
                    if k == self.last:
                        out = tf.reduce_mean(tf.cast(self.loss(ys[i], out), tf.float32)) / self.m
                if k == self.last:
                    total += out
                saved[(i, c)] = (tape, inp, out)
                self.peak_live = max(self.peak_live, sum(len(key) == 2 for key in saved))
            elif a.kind == "send_act":
                out = saved[(i, c)][2]
                self._check_out(out, specs[("out", c)], i, c)
                self.p2p.send(out.numpy(), a.peer, act_tag(k + 1))
            elif a.kind == "B":
                tape, inp, out = saved.pop((i, c))
                upstream = None if k == self.last else received.pop(("g", i, c))
                weights = self.chunks[c].trainable_variables
                got = tape.gradient(out, weights + ([inp] if k > 0 else []), output_gradients=upstream)
                self._accumulate(grads, c, got[:len(weights)])
                if k > 0:
                    saved[("g", i, c)] = got[-1]
            elif a.kind == "send_grad":
                self.p2p.send(saved.pop(("g", i, c)).numpy(), a.peer, grad_tag(k - 1))
            t1 = time.monotonic()
            kind = a.kind if a.kind in ("F", "B") else ("recv" if a.kind.startswith("recv") else None)
            if kind:
                self.events.append((kind, i, c, t0, t1))
                if tl is not None and kind != "recv":
                    tl.span(f"pipeline chunk {c}", "FORWARD" if kind == "F" else "BACKWARD", t0, t1,
                            {"micro_batch": i, "model_chunk": k})
        if self.p2p is not None:
            self.p2p.finish()
        self.schedule_span = (begin, time.monotonic())
        if tl is not None:
            tl.span("pipeline", "SCHEDULE", *self.schedule_span, {"schedule": self.schedule, "m": self.m})
        grads = self._reduce_data(grads)
        optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self._mean_loss(total)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _chunk_call(chunk, watch: bool):
        """The chunk's forward. ``watch`` (compiled, not the first stage): the input is watched inside
        the trace too: the caller's tape is outside the ``tf.function``, where a layer that
        recomputes (``keras.remat``, ``RematScope``: :mod:`tfops.training.remat`) cannot see it,
        and such a layer passes a gradient only to the arguments a tape records (without this, a
        recomputed first layer gave the input no gradient). The inner tape records while tracing
        only; the function holds no op of its own for it. Eagerly the caller's tape is the one."""
        def forward(inp):
            if not watch:
                return chunk(inp, training=True)
            with tf.GradientTape() as inside:
                inside.watch(inp)
                return chunk(inp, training=True)
        return forward

    def _post_ahead(self, j: int, specs: dict, posted: dict) -> None:
        """Post the receives among actions ``j .. j + AHEAD - 1`` not posted yet, so that each
        arrives while this rank computes (the progress thread moves it); at most a few boundary
        activations wait in buffers, not the whole step's."""
        for t in range(j, min(j + AHEAD, len(self.actions))):
            a = self.actions[t]
            if a.kind.startswith("recv") and t not in posted:
                side, tag = ("in", act_tag(self._k(a.chunk))) if a.kind == "recv_act" \
                    else ("out", grad_tag(self._k(a.chunk)))
                code, shape = specs[(side, a.chunk)]
                posted[t] = self.p2p.irecv(shape, tf.as_dtype(code).as_numpy_dtype, a.peer, tag)

    def _split(self, x, y):
        batch = x if x is not None else y
        if batch is None:
            raise MismatchError(f"Pipeline.train_step: rank {_api.rank()} got neither x nor y; every rank "
                                "passes the global batch (the others read only its length)")
        n = int(tf.shape(batch)[0])
        if n % self.m:
            raise MismatchError(f"Pipeline.train_step: the batch of {n} does not divide into {self.m} "
                                f"micro-batches (rank {_api.rank()}); pick a batch size that m divides")
        b = n // self.m
        cut = (lambda t: [t[i * b:(i + 1) * b] for i in range(self.m)] if t is not None else [None] * self.m)
        if (self.rank == 0 and x is None) or (self.rank == self.p - 1 and y is None):
            raise MismatchError(f"Pipeline.train_step: the first stage needs x and the last y (rank {_api.rank()})")
        return cut(tf.convert_to_tensor(x) if x is not None else None), \
            cut(tf.convert_to_tensor(y) if y is not None else None), b

    def _agree(self, b: int, x0, y0) -> dict:
        """Each boundary's (dtype, shape) for micro-batches of ``b``, agreed along the model once."""
        if b in self._specs:
            return self._specs[b]
        specs, problem = {}, None
        for c in range(self.v):
            k = self._k(c)
            spec = _spec(x0) if k == 0 else self.p2p.recv_spec((self.rank - 1) % self.p)
            specs[("in", c)], out = spec, BAD_SPEC
            if spec != BAD_SPEC and problem is None:
                try:
                    out = self._probe(c, k, spec, y0)
                except Exception as exc:                         # reported on every rank below
                    problem = (f"pipeline rank {self.rank} (global rank {_api.rank()}), model chunk {k}: "
                               f"given {_describe(spec)} from {'x' if k == 0 else f'model chunk {k - 1}'}: "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            specs[("out", c)] = out
            if k < self.last:
                self.p2p.send_spec(out, (self.rank + 1) % self.p)
        ids = [id(w) for w in self.trainable_variables]
        if problem is None and len(set(ids)) != len(ids):     # it would get its gradient applied twice
            problem = (f"pipeline rank {self.rank} (global rank {_api.rank()}): a weight appears twice in this "
                       "rank's chunks' trainable_variables (a layer tracked twice, e.g. a whole model kept as "
                       "an attribute of a stage); each weight must belong to one chunk, once")
        problems = [problem] if self.p2p is None else self.p2p.exchange_objects(problem)
        problems = [q for q in problems if q]
        if problems:
            raise MismatchError("Pipeline: the stages do not fit together: " + "; ".join(problems)
                                + ". Make each stage's output match the next stage's input.")
        self._specs[b] = specs
        return specs

    def _probe(self, c: int, k: int, spec, y0):
        """Run chunk ``c`` once on zeros of ``spec`` (builds it), check its declared input; its output spec."""
        code, shape = spec
        dtype = tf.as_dtype(code)
        try:
            declared = self.chunks[c].inputs           # a functional or Sequential model's Input
        except (AttributeError, ValueError):           # a subclassed model declares none
            declared = None
        if declared:
            want = declared[0]
            dims = tuple(want.shape)
            if len(dims) != len(shape) or any(w is not None and w != s for w, s in zip(dims[1:], shape[1:])):
                raise ValueError(f"its Input expects shape {dims}")
            if tf.as_dtype(want.dtype) != dtype:
                raise ValueError(f"its Input expects dtype {tf.as_dtype(want.dtype).name}")
        out = self.chunks[c](tf.zeros(shape, dtype), training=False)
        if k == self.last:                                 # the loss must take this output and y
            float(tf.reduce_mean(tf.cast(self.loss(y0, out), tf.float32)))
        return _spec(out)

    def _check_out(self, out, spec, i: int, c: int) -> None:
        if _spec(out) != spec:
            raise MismatchError(f"Pipeline: pipeline rank {self.rank}, micro-batch {i}, model chunk {self._k(c)} "
                                f"made {_describe(_spec(out))}, but {_describe(spec)} was agreed for this "
                                "micro-batch size; a stage's output must depend only on the input's shape")

    def _accumulate(self, grads: list, c: int, got: list) -> None:
        """Add micro-batch gradients ``got`` of chunk ``c`` into ``grads``, dense. An embedding's
        ``IndexedSlices`` become dense too: Keras' Adam squares a slice's entries before it sums
        duplicates (v += sum g_i^2, not (sum g_i)^2), so a sparse step depends on how the batch was
        cut; a dense sum is the full batch's gradient whatever m is."""
        start = sum(len(ch.trainable_variables) for ch in self.chunks[:c])
        for j, g in enumerate(got):
            if g is not None:
                g = tf.convert_to_tensor(g)
                grads[start + j] = g if grads[start + j] is None else grads[start + j] + g

    def _reduce_data(self, grads: list) -> list:
        weights = self.trainable_variables
        grads = [tf.zeros_like(w) if g is None else g for g, w in zip(grads, weights)]
        if self.mesh.data == 1:
            return grads
        import tfops as hvd                                 # the data axis: one fused averaged allreduce
        return hvd.grouped_allreduce(grads, op=hvd.Average, process_set=self.mesh.data_set)

    def _mean_loss(self, total) -> tf.Tensor:
        value = np.array(float(total), np.float32)
        if self.p2p is not None:
            value = self.p2p.share(value, self.p - 1, (), np.float32)
        if self.mesh.data > 1:
            import tfops as hvd
            value = hvd.allreduce(tf.constant(value), op=hvd.Average, process_set=self.mesh.data_set).numpy()
        return tf.constant(value, tf.float32)

    @staticmethod
    def _timeline():
        engine = getattr(_api, "_engine", None)            # the running engine's timeline, if one is on
        tl = getattr(engine, "timeline", None)
        return tl
