"""The whole optimizer state, gathered: checkpoints of a sharded optimizer that any rank count reads.

A plain Keras optimizer saves ``variables`` in one order: its own scalars (``iteration``,
``learning_rate``), then its slots, per model variable (``Adam``: ``m, v`` of the first variable,
``m, v`` of the second, ...; some optimizers write one slot kind after the other). A sharded
optimizer holds only its segments of each slot, so it writes the same list with every slot
gathered whole (one allgather per slot and variable, of each rank's segment: ``counts`` from
:mod:`.layout`) and reads it back by cutting out its own segments::

    Keras store / tf.train.Checkpoint:  0: iteration  1: learning_rate  2: w0.m (full)  3: w0.v  4: b0.m ...
    rank r reads 2 as                   w0.m.flat[var_start : var_start + size] of its segment of w0

The file is the one a plain optimizer writes, so it loads into a plain optimizer, into a
sharded one at any rank count, and a plain optimizer's file loads into a sharded one. Saving
and restoring are collectives: every rank saves (or restores) together.
The slot order is read off a probe: the inner optimizer's class built over two 1-element
variables, which shows whether it interleaves the slots per variable or writes them in blocks.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as _trackable

import allreduce as ar
from allreduce.algorithms.allgather import allgatherv

from ..collectives.dispatch import in_step

__all__ = ["GatheredState"]


def _slot_order(inner) -> tuple[int, list[str], bool]:
    """(how many own variables come first, the slot names, interleaved per variable?)."""
    probe = type(inner).from_config(inner.get_config())
    refs = []
    for k in range(2):
        with keras.name_scope(f"tfopsprobe{k}"):
            refs.append(keras.Variable(np.zeros([1], "float32"), name="x"))
    probe.build(refs)
    entries = []
    for v in probe.variables:
        tag = next((k for k in range(2) if v.name.startswith(f"tfopsprobe{k}_x_")), None)
        entries.append(None if tag is None else (tag, v.name[len(f"tfopsprobe{tag}_x_"):]))
    own = next((i for i, e in enumerate(entries) if e is not None), len(entries))
    slots = list(dict.fromkeys(e[1] for e in entries[own:]))
    interleaved = [(i, s) for i in range(2) for s in slots]
    blocked = [(i, s) for s in slots for i in range(2)]
    if entries[own:] not in (interleaved, blocked):
        raise TypeError(f"ShardedOptimizer cannot lay out {type(inner).__name__}'s state for a checkpoint: "
                        f"its variables are {[v.name for v in probe.variables]}")
    return own, slots, entries[own:] == interleaved


class _Entry(_trackable.Trackable):
    """One entry of the plain layout: a slot of one whole model variable, gathered when saved."""

    def __init__(self, state: "GatheredState", var: int, slot: str):
        self._state, self._var, self._slot = state, var, slot

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": tf.constant(self._state.gather(self._var, self._slot))}

    def _restore_from_tensors(self, restored_tensors):
        self._state.scatter(self._var, self._slot, restored_tensors["VARIABLE_VALUE"])


class _Indexed(_trackable.Trackable):
    """A list as a checkpoint sees it: children named 0, 1, ... (as Keras' ``_variables``)."""

    def __init__(self, items):
        self._items = list(items)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return {str(i): item for i, item in enumerate(self._items)}


class GatheredState:
    """The plain-layout view of a built :class:`~tfops.sharding.optimizer.ShardedOptimizerWrapper`."""

    def __init__(self, wrapper):
        self._w = wrapper
        inner = wrapper.inner_optimizer
        self._own_count, slots, interleaved = _slot_order(inner)
        n = len(wrapper._model_vars)
        self.order = [(i, s) for i in range(n) for s in slots] if interleaved else [(i, s) for s in slots for i in range(n)]
        prefixes = {sv.path.replace("/", "_") + "_": k for k, sv in enumerate(wrapper._seg_vars)}
        self._slot_vars: dict[tuple[int, str], tf.Variable] = {}
        for v in inner.variables[self._own_count:]:
            prefix = max((p for p in prefixes if v.name.startswith(p)), key=len)
            self._slot_vars[(wrapper._segments[prefixes[prefix]].var, v.name[len(prefix):])] = v
        self._entries = [_Entry(self, i, s) for i, s in self.order]

    def _own(self) -> list:
        return self._w.inner_optimizer.variables[:self._own_count]

    def _pieces(self, var: int) -> tuple[list[int], object]:
        """Every rank's element count of variable ``var`` and this rank's segment (or None)."""
        for sh in self._w._shards:
            if var in sh.vars:
                return sh.var_counts(var), next((s for s in self._w._segments if s.var == var), None)
        raise KeyError(var)

    def gather(self, var: int, slot: str) -> np.ndarray:
        """Slot ``slot`` of model variable ``var``, whole (a collective)."""
        model_var = self._w._model_vars[var]
        counts, seg = self._pieces(var)
        dtype = np.dtype(tf.as_dtype(model_var.dtype).as_numpy_dtype)
        mine = np.asarray(self._slot_vars[(var, slot)].numpy(), dtype) if seg else np.empty(0, dtype)
        out = np.empty(sum(counts), mine.dtype)
        comm = self._w._comm()
        if comm.size == 1:
            out[:] = mine
        else:
            in_step(lambda: allgatherv(comm.transport, np.ascontiguousarray(mine), out, counts), comm)()
        return out.reshape(tuple(model_var.shape))

    def scatter(self, var: int, slot: str, value) -> None:
        """Set this rank's segment of slot ``slot`` of ``var`` from the whole ``value``."""
        _, seg = self._pieces(var)
        if seg is not None:
            flat = np.asarray(value).reshape(-1)
            self._slot_vars[(var, slot)].assign(flat[seg.var_start:seg.var_start + seg.size])

    # -- Keras' store (model.save, save_weights) -------------------------------------------
    def save_to(self, store) -> None:
        own = self._own()
        for i, v in enumerate(own):
            store[str(i)] = v.numpy()
        for k, (var, slot) in enumerate(self.order):
            store[str(len(own) + k)] = self.gather(var, slot)

    def load_from(self, store) -> None:
        own = self._own()
        if len(store.keys()) != len(own) + len(self.order):
            raise ValueError(f"ShardedOptimizer: the checkpoint holds {len(store.keys())} optimizer variables, a "
                             f"{type(self._w.inner_optimizer).__name__} over this model has {len(own) + len(self.order)}")
        for i, v in enumerate(own):
            v.assign(store[str(i)])
        for k, (var, slot) in enumerate(self.order):
            self.scatter(var, slot, store[str(len(own) + k)])

    # -- tf.train.Checkpoint: a plain optimizer's keys ------------------------------------
    def trackable_children(self) -> dict:
        """The same objects every call (TF's checkpoint walk asks more than once)."""
        if getattr(self, "_children", None) is None:
            self._children = self._make_children()
        return self._children

    def _make_children(self) -> dict:
        own = self._own()
        children = {"_variables": _Indexed(own + self._entries)}
        names = {id(v): v.name for v in own}
        for v in own:
            if names[id(v)] in ("iteration", "iterations"):
                children["_iterations"] = v
            elif names[id(v)] == "learning_rate":
                children["_learning_rate"] = v
        return children
