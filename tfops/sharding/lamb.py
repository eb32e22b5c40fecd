"""Lamb over segments: Keras' Lamb, with the trust ratio's two norms taken over whole variables.

Lamb scales each variable's Adam-like update by ``|w| / |update|`` (You et al., 2020). On a
segment those norms would be a shard's, so :class:`SegmentLamb` updates the moments of all of
this rank's segments first, then sums the squares of every segment's weights and update, one
allreduce for all of them (:func:`.norms.squared_norms`), and scales each segment by its whole
variable's ratio. The moments and the arithmetic are ``keras.optimizers.Lamb``'s, term by term,
so the state is a Lamb's and checkpoints load into a plain Lamb.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from .norms import squared_norms

__all__ = ["SegmentLamb"]


class SegmentLamb(keras.optimizers.Lamb):
    """``keras.optimizers.Lamb`` whose variables are segments; ``owners[k]`` is the model variable
    that segment k belongs to, ``n_vars`` the model's count and ``comm`` the shards' communicator
    (set before the first step)."""

    owners: list[int] = []
    n_vars: int = 0
    comm = None

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        updates = []
        for gradient, variable in zip(grads, trainable_variables):     # Lamb.update_step, up to the norms
            lr = tf.cast(learning_rate, variable.dtype)
            gradient = tf.cast(gradient, variable.dtype)
            local_step = tf.cast(self.iterations + 1, variable.dtype)
            beta_1_power = tf.pow(tf.cast(self.beta_1, variable.dtype), local_step)
            beta_2_power = tf.pow(tf.cast(self.beta_2, variable.dtype), local_step)
            m = self._momentums[self._get_variable_index(variable)]
            v = self._velocities[self._get_variable_index(variable)]
            self.assign_add(m, (gradient - m) * (1 - self.beta_1))
            self.assign_add(v, (tf.square(gradient) - v) * (1 - self.beta_2))
            m_t_hat = m / (1.0 - beta_1_power)
            v_sqrt = tf.sqrt(v / (1.0 - beta_2_power)) + self.epsilon
            updates.append((variable, lr, m_t_hat / v_sqrt))
        w_sq, u_sq = squared_norms([[tf.convert_to_tensor(w) for w, _, _ in updates],
                                    [u for _, _, u in updates]], self.owners, self.n_vars, comm=self.comm)
        for (variable, lr, update), owner in zip(updates, self.owners):
            w_norm = tf.cast(tf.sqrt(w_sq[owner]), variable.dtype)
            g_norm = tf.cast(tf.sqrt(u_sq[owner]), variable.dtype)
            ratio = tf.where(w_norm > 0, tf.where(g_norm > 0, w_norm / g_norm, 1.0), 1.0)
            self.assign_sub(variable, ratio * lr * update)
