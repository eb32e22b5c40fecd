"""examples/gpt.py's ``--pipeline``: the GPT cut by blocks into pipeline stages (tfops.parallel.Pipeline).

    mpirun -np 2 python examples/gpt.py --pipeline 2 --layers 2 --quick                  # one block a stage
    mpirun -np 8 python examples/gpt.py --tensor 2 --pipeline 2 --layers 2 --quick       # 2 x 2 x 2: 3D
    mpirun -np 2 python examples/gpt.py --pipeline 2 --layers 4 --schedule interleaved --quick

Stage ``s`` of ``P`` holds blocks ``s L/P .. (s+1) L/P - 1``; the first also the embeddings, the last
also the final LayerNorm, the head and the (vocabulary-parallel) loss. Inside a stage the layers
are gpt.py's tensor-parallel ones over ``mesh.tensor_set``; the pipeline averages its gradients
over ``mesh.data_set``. Between stages only the (batch, seq, hidden) activations travel.

Each rank builds the whole GPT from the seed and keeps its own stage's layers (the simplest way
to give every stage the weights a one-process run starts from; a model too large for one device
would build only its stage's blocks).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tfops.parallel.pipeline import Pipeline

__all__ = ["GPTStage", "pipeline_of"]


class GPTStage(keras.Model):
    """Stage ``stage`` of ``stages``: a slice of ``model``'s layers (shared, not copied)."""

    def __init__(self, model, stage: int, stages: int):
        super().__init__()
        layers = model.cfg.layers
        if layers % stages:
            raise ValueError(f"--layers {layers} does not divide into {stages} model chunks (--pipeline, x2 interleaved)")
        per = layers // stages
        self.seq = model.cfg.seq                   # not the model itself: Keras would track all its weights
        self.first, self.last = stage == 0, stage == stages - 1
        self.blocks = model.blocks[stage * per:(stage + 1) * per]
        self.embed = [model.tok, model.pos] if self.first else []
        self.tail = [model.ln_f, model.head] if self.last else []

    def call(self, x, training=False):
        if self.first:
            tok, pos = self.embed
            x = tok(x) + pos(tf.range(self.seq))[None]
        for block in self.blocks:
            x = block(x)
        if self.last:
            ln_f, head = self.tail
            x = head(ln_f(x))
        return x

    def layer_list(self) -> list:
        """This stage's weight-holding layers, in gpt.GPT.layer_list's order."""
        out = list(self.embed)
        for b in self.blocks:
            out += [b.ln1, b.attn, b.ln2, b.up, b.down]
        return out + list(self.tail)


def pipeline_of(model, mesh, *, micro_batches: int, schedule: str = "1f1b") -> Pipeline:
    """A :class:`Pipeline` over this rank's stage of ``model`` (built on ``mesh``); interleaved gives
    each rank 2 chunks, chunk ``c`` of rank ``r`` being model chunk ``c * p + r``."""
    if model.cfg.sequence_parallel:
        raise ValueError("--pipeline with --sequence-parallel is not supported: the activations between "
                         "stages would be split along the sequence")
    p, r = mesh.pipeline, mesh.pipeline_rank
    v = 2 if schedule == "interleaved" else 1
    chunks = [GPTStage(model, c * p + r, p * v) for c in range(v)]
    return Pipeline(chunks if v > 1 else chunks[0], mesh, micro_batches, schedule,
                    loss=lambda y, logits: model.loss_of(logits, y))
