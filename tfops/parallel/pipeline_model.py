"""``PipelineModel``: reach a :class:`~tfops.parallel.Pipeline` from ``model.fit``.

::

    pipe = Pipeline(stage, mesh, micro_batches=8, schedule="1f1b", loss="mse" or a callable)
    model = PipelineModel(pipe)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))     # no loss here: the pipeline has it
    model.fit(x, y, batch_size=64, epochs=3, shuffle=False)  # every rank, the same x, y and order

Keras calls :meth:`PipelineModel.train_step` once a batch; it runs the whole schedule and returns
``{"loss": ...}``: the global batch's mean loss (the same on every rank) fed to Keras' loss
tracker, so the progress bar, ``History`` and the other callbacks (early stopping, checkpoints of
this rank's chunks) see the epoch's running mean as usual.

The schedule is driven from Python (each action a send, a receive or an eager chunk call), so
``compile`` always sets ``run_eagerly=True``; inside each chunk the layers run as TensorFlow ops.
Every rank must see the same batches in the same order (``shuffle=False``, or the same seed), since
the first stage reads ``x``, the last ``y``, and all of them cut the batch into micro-batches alike.
``predict``/``evaluate`` are not pipelined: :meth:`PipelineModel.call` says so.
"""
from __future__ import annotations

import keras

from .errors import MismatchError
from .pipeline import Pipeline

__all__ = ["PipelineModel"]


class PipelineModel(keras.Model):
    """A Keras model whose ``train_step`` runs ``pipeline``'s schedule.

    Args:
        pipeline: the :class:`Pipeline` of this rank's chunks.
    """

    def __init__(self, pipeline: Pipeline, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"PipelineModel takes a tfops.parallel.Pipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.chunks = pipeline.chunks                 # tracked: this rank's weights are the model's

    def compile(self, optimizer="sgd", **kwargs):
        if kwargs.get("loss") is not None:
            raise MismatchError("PipelineModel.compile: the loss belongs to the Pipeline (its last stage "
                                "computes it); pass loss= to Pipeline(...), not to compile")
        kwargs["run_eagerly"] = True                  # the schedule is Python: sends, receives, eager chunks
        super().compile(optimizer=optimizer, **kwargs)

    def call(self, inputs, training=False):
        raise TypeError("PipelineModel runs training only (fit / train_step): a forward pass needs every "
                        "stage; call this rank's chunks (model.chunks) directly, or run predict with the "
                        "whole model on one process")

    def train_step(self, data):
        x, y = data[0], data[1]
        loss = self.pipeline.train_step(x, y, self.optimizer)
        for metric in self.metrics:                   # Keras' loss tracker: the epoch's running mean
            if metric.name == "loss":
                metric.update_state(loss)
        return {"loss": loss} | {m.name: m.result() for m in self.metrics if m.name == "loss"}

    def build(self, input_shape=None):               # the chunks are built by the pipeline's first step
        self.built = True
