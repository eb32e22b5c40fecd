"""tfops.parallel: model parallelism for Keras 3 on TensorFlow (issue 42 onwards).

``Mesh`` (:mod:`.mesh`) lays the ranks out on tensor, data and pipeline axes and owns each axis's
process sets; layers and schedules take a mesh, and nothing else knows how ranks map to axes.

Tensor parallelism (Megatron-LM's, docs/16-tensor-parallelism.md):

* the region operators (:mod:`.regions`): ``copy_to_tensor_region`` (f), ``reduce_from_tensor_region``
  (g), scatter/gather along the last axis, and sequence parallelism's gather / reduce-scatter;
* layers named by how they split: :class:`ColumnParallelDense`, :class:`RowParallelDense` (:mod:`.dense`),
  :class:`VocabParallelEmbedding` (:mod:`.embedding`), :class:`ParallelMultiHeadAttention`
  (:mod:`.attention`), each with ``get_full_weights()`` / ``set_full_weights()`` in the plain
  Keras layer's layout and ``init="sliced"`` or ``"per_rank"`` (:mod:`.init`);
* :func:`vocab_parallel_cross_entropy` (:mod:`.cross_entropy`): the loss without gathering the logits.
"""
from __future__ import annotations

from .attention import ParallelMultiHeadAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .dense import ColumnParallelDense, RowParallelDense
from .embedding import VocabParallelEmbedding
from .errors import MeshError, MismatchError, ShapeError
from .mesh import Mesh
from .pipeline import Pipeline              # issue 43: pipeline parallelism (schedules in allreduce/schedules)
from .pipeline_model import PipelineModel
from .recompute import selective_recompute  # issue 44: recompute the attention core in backprop (Korthikanti)
from .regions import (allreduce_sequence_parallel_gradients, copy_to_tensor_region, gather_from_sequence_region, gather_from_tensor_region,
                      reduce_from_tensor_region, reduce_scatter_to_sequence_region, scatter_to_sequence_region,
                      scatter_to_tensor_region)

__all__ = ["Mesh", "Pipeline", "PipelineModel", "MeshError", "ShapeError", "MismatchError", "ColumnParallelDense", "RowParallelDense",
           "VocabParallelEmbedding", "ParallelMultiHeadAttention", "vocab_parallel_cross_entropy",
           "copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region",
           "gather_from_tensor_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "scatter_to_sequence_region", "allreduce_sequence_parallel_gradients", "selective_recompute"]
