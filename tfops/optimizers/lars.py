"""LARS: layer-wise adaptive rate scaling (You, Gitman and Ginsburg, "Large Batch Training of
Convolutional Networks", 2017), a Keras 3 optimizer. Keras 3 ships LAMB but not LARS.

The idea: one global learning rate fits no layer well when the batch is large. LARS gives every
layer (every variable) a *trust ratio*, the size of its weights against the size of its gradient,
so each layer moves by about the same fraction of its weights per step::

    layer:        w (weights)   g (gradient)       ||w||/||g||
    dense/kernel  |||||||||     ||                 large  -> larger steps
    dense_1/...   ||||          ||||||||           small  -> smaller steps

One step, per variable ``w`` with gradient ``g`` (``lr`` the global rate, ``m`` momentum,
``beta`` weight decay, ``eta`` the trust coefficient)::

    trust = eta * ||w|| / (||g|| + beta * ||w|| + epsilon)   # 1 where ||w|| = 0 or ||g|| = 0
    rate  = lr * trust                      # clip_trust_ratio=True: rate = min(trust, lr)
    g     = g + beta * w                    # weight decay folded into the gradient (L2)
    v     = m * v + rate * g                # velocity, rate inside (the paper's Algorithm 1)
    w     = w - v                           # nesterov=True: w = w - (m * v + rate * g)

Clipping is LARC's "clip" mode (NVIDIA apex ``LARC(clip=True)``, timm's ``trust_clip``): the
layer's rate is the trust ratio itself, capped at the global rate, so no layer ever moves faster
than ``lr`` allows and a warmup or decay of ``lr`` still bounds every layer. Without clipping (the
paper's, LARC's "scale" mode) the layer's rate is ``lr * trust``, which can exceed ``lr`` many times.
In clip mode ``eta`` is itself a rate (apex uses 0.02); in scale mode it multiplies ``lr`` (0.001).

Excluded variables take the plain rule: no trust ratio (``rate = lr``) and no weight decay.
By default every variable of rank <= 1 is excluded, the biases and the normalisation layers'
gamma and beta, as in the paper's successors (their norms say nothing about a layer's scale;
a bias that starts at zero has none to trust: a first step at ``lr``, then fractions of a small norm).
Excluded variables step at the global rate, which LARS sets far above SGD's; that suits networks
with batch normalisation, not necessarily a plain MLP's biases (lesson 15 shows both). More by name:
``exclude_from_weight_decay=["embedding"]``, ``exclude_from_layer_adaptation=["head"]`` (regular
expressions searched in ``variable.name``; a list given to only one of them does not apply to the
other), or later, before the first step, with the methods of the same names.

Cost per variable and step: two norms (2 reads of n values) and the update, 3 or 4 passes over n
values where SGD with momentum makes 2; no extra state beyond the momentum.
"""
from __future__ import annotations

import re

import keras
import tensorflow as tf
from keras import ops

__all__ = ["LARS"]


@keras.saving.register_keras_serializable(package="tfops", name="LARS")
class LARS(keras.optimizers.Optimizer):
    """SGD with momentum and a per-variable trust ratio (module docstring: the update, clipping).

    Args:
        learning_rate: the global rate ``lr``: a float, a schedule or a callable.
        momentum: ``m`` in [0, 1).
        nesterov: Nesterov momentum.
        weight_decay: ``beta`` >= 0, an L2 term added to the gradient and to the trust ratio's
            denominator (not Keras' decoupled decay).
        eta: the trust coefficient, > 0.
        epsilon: added to the trust ratio's denominator, >= 0.
        clip_trust_ratio: LARC clipping: the layer's rate is ``min(trust, lr)`` instead of ``lr * trust``.
        exclude_vectors: exclude every variable of rank <= 1 (biases, norms' gamma and beta).
        exclude_from_weight_decay: name patterns of variables that get no weight decay.
        exclude_from_layer_adaptation: name patterns of variables that get no trust ratio.
        name, kwargs: as for any ``keras.optimizers.Optimizer`` (clipnorm, ...).
    """

    def __init__(self, learning_rate=0.1, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, eta: float = 0.001, epsilon: float = 1e-8,
                 clip_trust_ratio: bool = False, exclude_vectors: bool = True,
                 exclude_from_weight_decay=None, exclude_from_layer_adaptation=None, name: str = "lars",
                 **kwargs):
        checks = [(0.0 <= momentum < 1.0, f"momentum must be in [0, 1), got {momentum}"),
                  (weight_decay is not None and weight_decay >= 0.0, f"weight_decay must be >= 0, got {weight_decay}"),
                  (eta > 0.0, f"eta must be > 0, got {eta}"), (epsilon >= 0.0, f"epsilon must be >= 0, got {epsilon}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"LARS: {message}")
        # Keras' own weight_decay is decoupled (w -= lr * wd * w before the step); LARS needs it
        # inside the gradient and the trust ratio, so the base class never sees it.
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.clip_trust_ratio = bool(clip_trust_ratio)
        self.exclude_vectors = bool(exclude_vectors)
        self._wd_names = list(exclude_from_weight_decay or [])
        self._adapt_names = list(exclude_from_layer_adaptation or [])
        self.exclude_from_weight_decay(var_names=self._wd_names)
        self.exclude_from_layer_adaptation(var_names=self._adapt_names)

    # -- which variables LARS adapts --------------------------------------------------------
    def exclude_from_layer_adaptation(self, var_list=None, var_names=None) -> None:
        """Give these variables (or those whose name matches one of ``var_names``) no trust ratio.

        Like Keras' ``exclude_from_weight_decay``: call it before the optimizer is built; each call
        replaces the previous one's choice.
        """
        if self.built:
            raise ValueError("LARS.exclude_from_layer_adaptation() must be called before the optimizer is built")
        self._no_adapt_keys = {self._var_key(v) for v in var_list or ()}
        self._no_adapt_pattern = re.compile("|".join(var_names)) if var_names else None

    def _adapts(self, variable) -> bool:
        if self.exclude_vectors and len(variable.shape) <= 1:
            return False
        if self._var_key(variable) in self._no_adapt_keys:
            return False
        return self._no_adapt_pattern is None or self._no_adapt_pattern.search(variable.name) is None

    def _decays(self, variable) -> bool:
        if self.lars_weight_decay == 0.0 or (self.exclude_vectors and len(variable.shape) <= 1):
            return False
        return self._use_weight_decay(variable)         # Keras' exclude_from_weight_decay choices

    def _apply_weight_decay(self, variables):
        """Nothing: the decay is part of :meth:`update_step` (an L2 term inside the trust ratio)."""

    # -- the step ----------------------------------------------------------------------------
    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient, variable, learning_rate):
        """One LARS step for ``variable`` (its rank and name decide, in Python, what applies)."""
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)      # the trust ratio needs the whole gradient's norm
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        g = ops.cast(gradient, dtype)
        beta = self.lars_weight_decay if self._decays(variable) else 0.0
        rate = lr
        if self._adapts(variable):
            w_norm = ops.sqrt(ops.sum(ops.square(variable)))
            g_norm = ops.sqrt(ops.sum(ops.square(g)))
            trust = self.eta * w_norm / (g_norm + beta * w_norm + self.epsilon)
            # A zero weight (just initialised to zeros) or a zero gradient: no scale to trust, ratio 1.
            trust = ops.where(ops.logical_and(w_norm > 0, g_norm > 0), trust, ops.ones_like(trust))
            rate = ops.minimum(trust, lr) if self.clip_trust_ratio else lr * trust
        if beta:
            g = g + beta * variable
        v = self._velocities[self._get_variable_index(variable)]
        step = rate * g
        self.assign(v, self.momentum * v + step)
        self.assign_sub(variable, self.momentum * v + step if self.nesterov else v)

    def get_config(self):
        config = super().get_config()
        config.update({"momentum": self.momentum, "nesterov": self.nesterov,
                       "weight_decay": self.lars_weight_decay, "eta": self.eta, "epsilon": self.epsilon,
                       "clip_trust_ratio": self.clip_trust_ratio, "exclude_vectors": self.exclude_vectors,
                       "exclude_from_weight_decay": self._wd_names,
                       "exclude_from_layer_adaptation": self._adapt_names})
        return config
