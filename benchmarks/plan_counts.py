"""What a traced training step keeps alive, counted from its graph (benchmarks/plan_bench.py's counts).

    kept_activations(graph, loss)          forward tensors the backward pass reads, by name
    rebuilt_activation_bytes(graph, loss)  what a recomputed unit keeps while its backward runs

The graph is a ``tf.function``'s: every shape is static, so bytes are exact. Steps of the first:
(1) the forward pass is every op the loss depends on through data; (2) the ops the step runs are
the ancestors of its outputs and control outputs (a custom gradient's spare identities are not);
(3) each tensor of (1) that an op of (2) outside (1) reads is kept from forward to backward,
followed through ops that forward their input's buffer (Reshape, Identity, IdentityN) to the
tensor that owns the memory, counted once. Variable reads and constants are weights, not
activations; a float placeholder is a received activation (a pipeline stage's input) and counts.
Cost: linear in the graph's ops.
"""
from __future__ import annotations

__all__ = ["SEED", "kept_activations", "kept_activation_bytes", "rebuilt_activation_bytes"]


def kept_activation_bytes(graph, loss) -> int:
    """Bytes of the forward tensors the backward pass reads in a traced training step."""
    return sum(kept_activations(graph, loss).values())


def kept_activations(graph, loss) -> dict[str, int]:
    """The forward tensors the backward pass reads in a traced training step: bytes by tensor name.

    The forward pass is every op the loss's value depends on. An op outside it that the step runs
    (the step's outputs or control outputs depend on it: the gradients, the update) and that reads a
    forward tensor keeps that tensor alive from forward to backward; ops nothing runs (a custom
    gradient's spare identities) keep nothing. A Reshape, Identity or IdentityN shares its input's
    buffer (IdentityN output i is input i), so each is followed to the tensor that owns the memory,
    counted once; variable reads and constants are weights, not activations."""
    forward = _ancestors([loss.op], control=False)      # data only: the step's output waits on the update too
    runs = _ancestors([t.op for t in graph.outputs] + list(graph.control_outputs), control=True)
    owners = set()
    for op in runs - forward:
        for t in op.inputs:
            t = _owner(t)
            if t.op in forward and t.op.type not in _NOT_ACTIVATIONS:
                owners.add(t.ref())
    tensors = [r.deref() for r in owners]
    return {t.name: t.shape.num_elements() * t.dtype.size for t in tensors
            if t.dtype.is_floating and t.shape.is_fully_defined()}


SEED = "plan_bench_seed"


def rebuilt_activation_bytes(graph, loss) -> int:
    """Bytes the backward pass keeps of the largest unit it runs forward again: tfops' stage 3
    gathers a unit's weights again in backward and re-runs its call under a tape (0 without).

    The gradient flow is every op the loss's gradient seed (the op named ``SEED``) reaches through
    data. A recomputed op is one the step runs outside the forward pass and the gradient flow that
    the backward's gathered weights (``tfops_fs_gather`` ops outside the forward) feed through data,
    less the tape's own gradient temporaries (ops in its ``gradient_tape/`` scope, such as GELU's
    exp(-x^2/2)), which no count here includes. Its tensors that the backward reads are kept while
    that unit's backward runs. Units are the connected pieces of the recomputed ops (a unit's
    recompute reads the forward's tensors and its own gathered weights, never another unit's), and
    one is rebuilt at a time: the largest piece counts."""
    try:
        seed = graph.get_operation_by_name(SEED)
    except KeyError:
        return 0
    forward = _ancestors([loss.op], control=False)
    runs = _ancestors([t.op for t in graph.outputs] + list(graph.control_outputs), control=True)
    gathers = [op for op in runs - forward if op.name.rsplit("/", 1)[-1].startswith("tfops_fs_gather")]
    flow, fed = _descendants([seed]), _descendants(gathers)
    redo = {op for op in (fed & runs) - forward - flow - set(gathers)
            if not op.name.startswith("gradient_tape/") and op.type not in ("PyFunc", "EagerPyFunc")}
    kept = {}
    for op in runs - forward - redo:
        for t in op.inputs:
            t = _owner(t)
            if t.op in redo and t.dtype.is_floating and t.shape.is_fully_defined():
                kept[t.ref()] = t.shape.num_elements() * t.dtype.size
    piece = {op: op for op in redo}                   # union-find over the recomputed ops' data edges

    def root(op):
        while piece[op] is not op:
            piece[op] = piece[piece[op]]
            op = piece[op]
        return op
    for op in redo:
        for t in op.inputs:
            if t.op in redo:
                piece[root(t.op)] = root(op)
    sizes: dict = {}
    for ref, n in kept.items():
        r = root(ref.deref().op)
        sizes[r] = sizes.get(r, 0) + n
    return max(sizes.values(), default=0)


def _descendants(ops) -> set:
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack += [c for t in op.outputs for c in t.consumers()]
    return seen


def _ancestors(ops, *, control: bool) -> set:
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack += [t.op for t in op.inputs] + (list(op.control_inputs) if control else [])
    return seen


def _owner(t):
    """The tensor whose buffer ``t`` is (through ops that forward their input unchanged)."""
    while t.op.type in _ALIASES and t.op.inputs:
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
    return t


_ALIASES = {"Reshape", "Identity", "IdentityN", "ExpandDims", "Squeeze"}
_NOT_ACTIVATIONS = {"ReadVariableOp", "Const", "VarHandleOp", "ResourceGather"}
