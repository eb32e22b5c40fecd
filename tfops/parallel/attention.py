"""Multi-head attention with its heads split over the tensor group (Megatron's ``ParallelAttention``).

::

    x ──f──> [Q K V for heads 0..H/t-1] ─> attention ─> out-proj rows 0..H/t-1 ─┐
       (copy)                                            (rank 0)                ├─g──> + bias
          └─> [Q K V for heads H/t..2H/t-1] ─> attention ─> out-proj rows ... ──┘
                                                         (rank 1)

Heads are independent, so Q, K and V are column-parallel (each rank computes its H/t heads' Q, K,
V from the whole input) and the output projection is row-parallel (each rank's heads give a
partial sum of the output): one f on the way in, one g on the way out, as in the MLP. With
``sequence_parallel`` f is an allgather along the sequence, g a reduce-scatter along it, and the
output bias is one of ``sequence_parallel_weights`` (see :mod:`tfops.parallel.dense`).

Called as ``keras.layers.MultiHeadAttention`` is: ``layer(query, value, key=None)``; inputs that are
the same tensor enter the region once (self-attention: one f, so one allreduce backward). The
weights are ``MultiHeadAttention``'s, in its ``get_weights()`` order: query, key, value kernels
``(dim, heads, key_dim)`` and biases ``(heads, key_dim)``, split along heads; the output kernel
``(heads, value_dim, dim)``, split along heads; its bias replicated.

Cost per call: 1 allreduce of the (batch, seq, dim) activation forward and 1 backward; 1/t of the
projections' flops and weights; attention itself runs on 1/t of the heads.
"""
from __future__ import annotations

import math

import keras
from keras import ops

from . import regions
from .init import SplitLayer, agree, divide, initial_slice

__all__ = ["ParallelMultiHeadAttention"]


class ParallelMultiHeadAttention(SplitLayer):
    """``keras.layers.MultiHeadAttention`` with heads split over the tensor group.

    Args:
        num_heads: the full layer's heads (divisible by the tensor size).
        key_dim: the size of each head for query and key; ``value_dim`` (default ``key_dim``) for value.
        mesh: a :class:`~tfops.parallel.Mesh` (default: the last one built).
        causal: a causal mask (``use_causal_mask=True`` on every call of the Keras layer).
        use_bias, kernel_initializer, bias_initializer: as ``keras.layers.MultiHeadAttention``.
        sequence_parallel: inputs and output are split along axis 1 (the sequence).
        init: ``"sliced"`` or ``"per_rank"`` (:mod:`tfops.parallel.init`).
    """

    def __init__(self, num_heads: int, key_dim: int, mesh=None, causal: bool = False, *, value_dim: int | None = None,
                 use_bias: bool = True, sequence_parallel: bool = False, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", init: str = "sliced", **kwargs):
        super().__init__(mesh, init, **kwargs)
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim or key_dim
        self.causal, self.use_bias, self.sequence_parallel = causal, use_bias, sequence_parallel
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.local_heads = divide(num_heads, self.mesh, f"{type(self).__name__} num_heads")

    def _projection(self, name, dim, size):
        """A (dim, heads, size) kernel and (heads, size) bias, split along heads."""
        full = (dim, self.num_heads, size)
        kernel = self._register(self.add_weight(
            name=f"{name}_kernel", shape=(dim, self.local_heads, size),
            initializer=initial_slice(self.kernel_initializer, full, 1, self.mesh, self.init)), 1, full)
        bias = None
        if self.use_bias:
            bias = self._register(self.add_weight(
                name=f"{name}_bias", shape=(self.local_heads, size),
                initializer=initial_slice(self.bias_initializer, full[1:], 0, self.mesh, self.init)), 0, full[1:])
        return kernel, bias

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        dim = query_shape[-1]
        agree(self.name, {"layer": "ParallelMultiHeadAttention", "heads": self.num_heads, "key_dim": self.key_dim,
                          "value_dim": self.value_dim, "dims": (dim, key_shape[-1], value_shape[-1])}, self.mesh)
        self.query = self._projection("query", dim, self.key_dim)
        self.key = self._projection("key", key_shape[-1], self.key_dim)
        self.value = self._projection("value", value_shape[-1], self.value_dim)
        full = (self.num_heads, self.value_dim, dim)
        self.output_kernel = self._register(self.add_weight(
            name="output_kernel", shape=(self.local_heads, self.value_dim, dim),
            initializer=initial_slice(self.kernel_initializer, full, 0, self.mesh, self.init)), 0, full)
        self.output_bias = None
        if self.use_bias:
            self.output_bias = self._register(self.add_weight(name="output_bias", shape=(dim,),
                                                              initializer=self.bias_initializer), None, (dim,))
            if self.sequence_parallel:        # its gradient sees only my part of the sequence
                self.sequence_parallel_weights.append(self.output_bias)

    def _enter(self, x):
        if self.sequence_parallel:
            return regions.gather_from_sequence_region(x, self.mesh)    # allgather | reduce-scatter
        return regions.copy_to_tensor_region(x, self.mesh)             # identity  | allreduce

    @staticmethod
    def _project(x, weights):
        kernel, bias = weights
        y = ops.einsum("abc,cde->abde", x, kernel)
        return y if bias is None else y + bias

    def call(self, query, value, key=None):
        key = value if key is None else key
        entered = {}                                   # one f per distinct input tensor
        for x in (query, value, key):
            if id(x) not in entered:
                entered[id(x)] = self._enter(x)
        q = self._project(entered[id(query)], self.query)
        k = self._project(entered[id(key)], self.key)
        v = self._project(entered[id(value)], self.value)
        attended = ops.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.key_dim), is_causal=self.causal)
        y = ops.einsum("abcd,cde->abe", attended, self.output_kernel)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence_region(y, self.mesh)  # reduce-scatter | allgather
        else:
            y = regions.reduce_from_tensor_region(y, self.mesh)          # allreduce | identity
        if self.output_bias is not None:
            y = y + self.output_bias
        return y

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return tuple(query_shape)
