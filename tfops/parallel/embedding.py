"""An embedding table split by rows (vocabulary ids) over the tensor group (Megatron's
``VocabParallelEmbedding``).

::

    table (V rows, padded to a multiple of t)      ids [7, 1, 5] on t = 2, V = 8
        rank 0: rows 0..3                          rank 0: [0, row 1, 0]      (7 and 5 are not mine: zero rows)
        rank 1: rows 4..7                          rank 1: [row 7, 0, row 5]
                                                   g (allreduce): [row 7, row 1, row 5] on both

Steps: shift the ids into my range, zero the rows of ids outside it, then g (allreduce forward,
identity backward), or with ``sequence_parallel`` a reduce-scatter along the sequence (each rank
keeps its part of the sequence). The backward is local: each rank's gradient reaches only its own
rows. A vocabulary the tensor size does not divide is padded with zero rows, as Megatron pads it
(never looked up: ids are below ``input_dim``); the full weights leave the padding out.

Cost: one allreduce of the (batch, seq, output_dim) output forward; none backward. Table memory 1/t.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from . import regions
from .init import SplitLayer, agree, initial_slice

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(SplitLayer):
    """``keras.layers.Embedding`` with its rows split over the tensor group.

    Args:
        input_dim: the vocabulary size (padded up to a multiple of the tensor size inside).
        output_dim: the embedding width.
        mesh: a :class:`~tfops.parallel.Mesh` (default: the last one built).
        embeddings_initializer: as ``keras.layers.Embedding`` (default ``"uniform"``).
        sequence_parallel: reduce-scatter the output along axis 1 instead of allreducing it.
        init: ``"sliced"`` or ``"per_rank"`` (:mod:`tfops.parallel.init`).
    """

    def __init__(self, input_dim: int, output_dim: int, mesh=None, *, embeddings_initializer="uniform",
                 sequence_parallel: bool = False, init: str = "sliced", **kwargs):
        super().__init__(mesh, init, **kwargs)
        self.input_dim, self.output_dim, self.sequence_parallel = input_dim, output_dim, sequence_parallel
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        t = self.mesh.tensor
        self.padded_dim = -(-input_dim // t) * t
        self.rows = self.padded_dim // t
        self.start = self.rows * self.mesh.tensor_rank

    def build(self, input_shape=None):
        agree(self.name, {"layer": "VocabParallelEmbedding", "input_dim": self.input_dim,
                          "output_dim": self.output_dim}, self.mesh)
        pad = self.padded_dim - self.input_dim
        initializer = initial_slice(self.embeddings_initializer, (self.padded_dim, self.output_dim), 0, self.mesh,
                                    self.init)
        if self.init == "sliced" and pad:    # draw the plain layer's (input_dim, output_dim), then pad with zeros
            plain = keras.initializers.get(self.embeddings_initializer)

            def initializer(shape, dtype=None):
                full = tf.concat([plain((self.input_dim, self.output_dim), dtype=dtype),
                                  tf.zeros((pad, self.output_dim), dtype)], 0)
                return full[self.start:self.start + self.rows]
        self.embeddings = self._register(self.add_weight(name="embeddings", shape=(self.rows, self.output_dim),
                                                         initializer=initializer),
                                         0, (self.input_dim, self.output_dim), pad)
        if self.init == "per_rank" and pad:   # the padding rows stay zero
            keep = tf.cast(tf.range(self.start, self.start + self.rows) < self.input_dim, self.embeddings.dtype)
            self.embeddings.assign(self.embeddings * keep[:, None])

    def call(self, ids):
        ids = tf.cast(ids, tf.int32)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        rows = tf.gather(self.embeddings, tf.where(mine, local, 0))
        rows = rows * tf.cast(mine, rows.dtype)[..., None]            # ids that are not mine: zero rows
        if self.sequence_parallel:
            return regions.reduce_scatter_to_sequence_region(rows, self.mesh)   # reduce-scatter | allgather
        return regions.reduce_from_tensor_region(rows, self.mesh)               # allreduce | identity

    def compute_output_shape(self, input_shape):
        shape = list(input_shape) + [self.output_dim]
        if self.sequence_parallel and len(shape) > 2 and shape[1] is not None:
            shape[1] //= self.mesh.tensor
        return tuple(shape)
