"""Dense layers split over the tensor group, named by how they split (Megatron's ``layers.py``).

::

    ColumnParallelDense: Y = X A,  A = [A_0 | A_1]  (columns)       RowParallelDense: Y = X B,  B = [B_0 ; B_1]  (rows)

        X ──f──┬── X A_0 ─> Y_0   (rank 0)                            Y_0 ── Y_0 B_0 ──┐
               └── X A_1 ─> Y_1   (rank 1)                            Y_1 ── Y_1 B_1 ──┴─g──> Y_0 B_0 + Y_1 B_1 + b

    f: identity forward, allreduce backward          g: allreduce forward, identity backward

A column layer followed by a row layer (an MLP's two matmuls, attention's QKV then output) needs
no communication between them: each rank's ``Y_i`` is exactly the input its ``B_i`` needs. So one
allreduce forward (g) and one backward (f) per pair. The row layer adds its bias once, after g.

With ``sequence_parallel=True`` the input of a column layer and the output of a row layer are split
along the sequence axis (axis 1): f becomes an allgather along it (reduce-scatter backward) and g a
reduce-scatter (allgather backward). The row layer's bias, replicated, then sees only part of the
sequence on each rank: it is listed in ``sequence_parallel_weights``, whose gradients
:func:`tfops.parallel.allreduce_sequence_parallel_gradients` sums over the group in one allreduce
per step, as Megatron does (it marks them ``sequence_parallel`` and sums them before the step).

Cost per pair, t ranks, activation of n bytes: 2 x (allreduce of n) per step, compute 1/t of the matmuls.
Weights and their gradients and Adam state: 1/t of the plain layers' (the row bias is replicated).
"""
from __future__ import annotations

import keras
from keras import ops

from . import regions
from .init import SplitLayer, agree, divide, initial_slice

__all__ = ["ColumnParallelDense", "RowParallelDense"]


class ColumnParallelDense(SplitLayer):
    """``keras.layers.Dense`` with its output units split over the tensor group.

    Args:
        units: the full layer's units (divisible by the tensor size).
        mesh: a :class:`~tfops.parallel.Mesh` (default: the last one built).
        activation, use_bias, kernel_initializer, bias_initializer: as ``keras.layers.Dense``.
        gather_output: allgather the output's units (every rank gets the full output); otherwise each
            rank keeps its ``units / tensor`` (the input a :class:`RowParallelDense` wants).
        sequence_parallel: the input is split along axis 1 (the sequence); it is gathered here.
        init: ``"sliced"`` (every rank draws the full kernel, keeps its slice) or ``"per_rank"``
            (each rank draws only its slice): :mod:`tfops.parallel.init`.
    """

    def __init__(self, units: int, mesh=None, activation=None, use_bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, *, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 init: str = "sliced", **kwargs):
        super().__init__(mesh, init, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.local_units = divide(units, self.mesh, f"{type(self).__name__} units")

    def build(self, input_shape):
        n_in = input_shape[-1]
        agree(self.name, {"layer": "ColumnParallelDense", "input": n_in, "units": self.units,
                          "bias": self.use_bias, "gather_output": self.gather_output}, self.mesh)
        self.kernel = self._register(self.add_weight(
            name="kernel", shape=(n_in, self.local_units),
            initializer=initial_slice(self.kernel_initializer, (n_in, self.units), 1, self.mesh, self.init)),
            1, (n_in, self.units))
        self.bias = None
        if self.use_bias:
            self.bias = self._register(self.add_weight(
                name="bias", shape=(self.local_units,),
                initializer=initial_slice(self.bias_initializer, (self.units,), 0, self.mesh, self.init)),
                0, (self.units,))

    def call(self, x):
        if self.sequence_parallel:
            x = regions.gather_from_sequence_region(x, self.mesh)     # allgather | reduce-scatter
        else:
            x = regions.copy_to_tensor_region(x, self.mesh)           # identity  | allreduce
        y = ops.matmul(x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        return regions.gather_from_tensor_region(y, self.mesh) if self.gather_output else y

    def compute_output_shape(self, input_shape):
        seq = list(input_shape[:-1])
        if self.sequence_parallel and len(seq) > 1 and seq[1] is not None:
            seq[1] *= self.mesh.tensor
        return tuple(seq) + (self.units if self.gather_output else self.local_units,)


class RowParallelDense(SplitLayer):
    """``keras.layers.Dense`` with its input units split over the tensor group; the bias is added once,
    after the reduction.

    Args:
        units: output units (every rank gets them all).
        mesh: a :class:`~tfops.parallel.Mesh` (default: the last one built).
        use_bias, activation, kernel_initializer, bias_initializer: as ``keras.layers.Dense``.
        input_is_parallel: the input is already split (a :class:`ColumnParallelDense`'s output);
            otherwise it is the full input and each rank takes its slice here.
        sequence_parallel: reduce-scatter the output along axis 1 instead of allreducing it.
        init: ``"sliced"`` or ``"per_rank"`` (:mod:`tfops.parallel.init`).
    """

    def __init__(self, units: int, mesh=None, use_bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, *, activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", init: str = "sliced", **kwargs):
        super().__init__(mesh, init, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        n_in = input_shape[-1] * self.mesh.tensor if self.input_is_parallel else input_shape[-1]
        local_in = divide(n_in, self.mesh, f"{type(self).__name__} input units")
        agree(self.name, {"layer": "RowParallelDense", "input": n_in, "units": self.units, "bias": self.use_bias},
              self.mesh)
        self.kernel = self._register(self.add_weight(
            name="kernel", shape=(local_in, self.units),
            initializer=initial_slice(self.kernel_initializer, (n_in, self.units), 0, self.mesh, self.init)),
            0, (n_in, self.units))
        self.bias = None
        if self.use_bias:                     # replicated: every rank of the group holds all of it
            self.bias = self._register(self.add_weight(name="bias", shape=(self.units,),
                                                       initializer=self.bias_initializer), None, (self.units,))
            if self.sequence_parallel:        # its gradient sees only my part of the sequence
                self.sequence_parallel_weights.append(self.bias)

    def call(self, x):
        if not self.input_is_parallel:
            x = regions.scatter_to_tensor_region(x, self.mesh)         # my slice | allgather
        y = ops.matmul(x, self.kernel)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence_region(y, self.mesh)   # reduce-scatter | allgather
        else:
            y = regions.reduce_from_tensor_region(y, self.mesh)        # allreduce | identity
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        seq = list(input_shape[:-1])
        if self.sequence_parallel and len(seq) > 1 and seq[1] is not None:
            seq[1] //= self.mesh.tensor
        return tuple(seq) + (self.units,)
