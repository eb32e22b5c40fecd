"""``allreduce-plan``: will a model fit, and which layout trains it fastest?

Pure arithmetic (no TensorFlow): :mod:`.model` says what is trained (a parameter count or a
transformer's shape, and the bytes per number), :mod:`.memory` the bytes on the fullest device
(weights, gradients, optimizer state by ZeRO stage; activations by Korthikanti's formula with
tensor/sequence parallelism and recompute), :mod:`.time` the step's seconds (compute rate,
bubble, and the collectives priced by :mod:`allreduce.algorithms.select`), :mod:`.search`
every layout of N devices, :mod:`.cli` the command. Lesson 18 walks through it.
"""
from .memory import RECOMPUTE, Breakdown, Layout, memory, zero_bytes
from .model import PRECISIONS, PRESETS, Params, Precision, Transformer
from .search import Plan, evaluate, layouts, search
from .time import Machine, StepTime, step_time

__all__ = ["Params", "Transformer", "Precision", "PRECISIONS", "PRESETS", "Layout", "Breakdown", "RECOMPUTE",
           "memory", "zero_bytes", "Machine", "StepTime", "step_time", "Plan", "layouts", "evaluate", "search"]
