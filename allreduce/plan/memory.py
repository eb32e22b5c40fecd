"""Bytes per device: weights, gradients, optimizer state and activations, for one layout.

A layout is (data d, tensor t, pipeline p, ZeRO stage z, recompute r), with micro-batches of
b sequences, m of them per step. The rank holding the most is the one that decides, so every
pipeline stage is counted and the largest reported.

Model states, per parameter P this device owns after tensor and pipeline splitting
(P = Psi / (t p) for a bare count; a transformer's stage: its L/p layers / t, plus the
embedding on the first stage and its tied copy on the last), ZeRO sharding over the d ranks
of the data group (Rajbhandari et al. 2019, Figure 1, with w, g, k the bytes of a weight, a
gradient and the optimizer state)::

    stage 0   (w + g + k) P
    stage 1   (w + g) P + k P / d
    stage 2    w P + (g + k) P / d
    stage 3   (w + g + k) P / d   + the layers gathered to run: this one and the one prefetched

Mixed-precision Adam (w, g, k = 2, 2, 12), 7.5 B on 64 GPUs: 120, 31.4, 16.6, 1.9 GB.

Activations of one layer for one micro-batch (``Transformer.kept="megatron"``; "keras" keeps
more, see :data:`KEPT`) (Korthikanti et al. 2022, section 4: bytes
s b h (34 + 5 a s / h) in fp16 with dropout). In elements: 4 s b h that tensor parallelism
does not split (2 layernorm inputs, the QKV input, the MLP input), 4 s b h + 2 s b f that it
does (Q, K, V, the projection's input, the MLP's two f-wide arrays), and a s^2 b attention
scores (twice with dropout: the softmax and its dropped copy), plus 1-byte dropout masks::

    none        s b h (e 4 + 2) / t_sp  +  s b h e (4 + 2 f/h) / t  +  a s^2 b (2e + 1) / t
    selective   the same without the a s^2 b term: attention scores are recomputed in backward
    full        s b h e / t_sp per layer (its input), and one layer's 'none' bytes, rebuilt in backward

where e is bytes per element and t_sp = t with sequence parallelism, else 1 (fp16 with
dropout: 34 and 5). Under full recompute the layer being rebuilt holds its 'none' bytes less its
input, which is already counted. Under 1F1B, stage k holds min(p - k, m) micro-batches in flight;
the last stage also holds the logits in fp32 for the loss, 4 s b v / t (Korthikanti, eq. 3).

Keras layers on TensorFlow (``kept="keras"``, examples/gpt.py, counted in its traced step by
benchmarks/plan_bench.py) keep more at the top of the model as well: the final LayerNormalization
keeps its input, its normalized product and its output (3 s b h e; under full recompute, where
the final norm and the head are units of their own, only the input of each: 2 s b h e), and the
vocabulary-parallel loss keeps two fp32 arrays of the logits' size (exp(z - max) and the one-hot
of the labels): 2 x 4 s b v / t.

ZeRO 3 as FSDP and tfops' ``fully_shard`` run it adds, on top of the 1/d shards, the whole weights
of the layer running and of the one prefetched (2 layers), and in backward the running layer's
whole gradients until their reduce-scatter has taken them (1 layer). tfops' stage 3 also
re-runs every unit in backward (it keeps only each unit's input): plan it with recompute "full".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import Params, Precision, Transformer

__all__ = ["Layout", "Breakdown", "RECOMPUTE", "memory", "zero_bytes"]

RECOMPUTE = ("none", "selective", "full")

#: Elements of s*b*h one layer keeps: (not split by t, split by t, and x f/h split by t), by what
#: implements the layer. "megatron": Korthikanti's count (fused kernels): 2 layernorm inputs plus
#: the attention's and the MLP's inputs; Q, K, V and the projection's input; the MLP's two f-wide
#: arrays. "keras": the same layer from Keras 3 layers on TensorFlow, as the traced step of
#: examples/gpt.py keeps them (benchmarks/plan_bench.py counts them): each LayerNormalization
#: keeps its normalized product as well as its input (+2), and the exact GELU keeps erfc, x*erfc
#: and x^2 besides its output (+2 f-wide arrays).
KEPT = {"megatron": (4, 4, 2), "keras": (6, 4, 4)}


@dataclass(frozen=True)
class Layout:
    """One way to place the training on ``data * tensor * pipeline`` devices."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    zero: int = 0                    #: ZeRO stage 0 (none) .. 3, over the data group
    recompute: str = "none"          #: "none", "selective" (attention core) or "full" (every layer)
    micro_batch: int = 1             #: sequences per micro-batch, b
    microbatches: int = 1            #: micro-batches per step per data rank, m
    sequence_parallel: bool = False  #: split the layernorm/dropout activations over t too
    chunks: int = 1                  #: interleaved stages per device, v (bubble (p-1)/(v m))

    def __post_init__(self):
        if min(self.data, self.tensor, self.pipeline, self.micro_batch, self.microbatches, self.chunks) < 1:
            raise ValueError(f"every size of a layout is at least 1: {self}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage is 0, 1, 2 or 3, got {self.zero}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute is one of {RECOMPUTE}, got {self.recompute!r}")

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline

    def label(self) -> str:
        return (f"d{self.data} t{self.tensor} p{self.pipeline} zero{self.zero} {self.recompute}"
                f"{' sp' if self.sequence_parallel else ''}")


@dataclass
class Breakdown:
    """Bytes on the fullest device, by kind; ``lines`` is the arithmetic, for ``--explain``."""

    weights: float = 0.0
    grads: float = 0.0
    state: float = 0.0
    activations: float = 0.0
    stage: int = 0                   #: the pipeline stage that holds the most
    params: int = 0                  #: parameters that stage owns before ZeRO
    lines: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.state + self.activations


def zero_bytes(params: float, precision: Precision, stage: int, data: int) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer state)`` bytes of ``params`` at ZeRO ``stage`` over ``data`` ranks."""
    w, g, k = params * precision.weight, params * precision.grad, params * precision.state
    return (w / data if stage >= 3 else w, g / data if stage >= 2 else g, k / data if stage >= 1 else k)


def memory(model: Params | Transformer, layout: Layout, precision: Precision, *,
           extra_grad: float = 0.0, extra_state_sharded: float = 0.0) -> Breakdown:
    """The fullest device's bytes for ``model`` placed by ``layout``.

    ``extra_grad`` / ``extra_state_sharded``: bytes per parameter an implementation keeps beyond
    the formula (tfops' DistributedOptimizer keeps the reduced copy of every gradient: 4; its
    stages 1-2 keep the inner optimizer's copy of the weight slice: 4, sharded)."""
    stages = [_stage(model, layout, precision, k, extra_grad, extra_state_sharded) for k in range(layout.pipeline)]
    return max(stages, key=lambda b: (b.total, -b.stage))


def _stage_params(model: Params | Transformer, layout: Layout, k: int) -> tuple[float, str]:
    t, p = layout.tensor, layout.pipeline
    if isinstance(model, Params):
        return model.params / (t * p), f"P = {model.params:.6g} / (t {t} x p {p})"
    layers = _stage_layers(model, p, k)
    n = layers * model.layer_params()
    how = f"{layers} layers x {model.layer_params()}"
    if k == 0:
        n, how = n + model.embedding_params(), how + f" + embedding {model.embedding_params()}"
    if k == p - 1:
        head = model.head_params() + (model.vocab * model.hidden if model.tied and p > 1 else 0)
        n, how = n + head, how + f" + output {head}"
    return n / t, f"P = ({how}) / t {t}"


def _stage_layers(model: Transformer, p: int, k: int) -> int:
    base, rest = divmod(model.layers, p)
    return base + (1 if k < rest else 0)


def _stage(model, layout: Layout, precision: Precision, k: int, extra_grad: float,
           extra_state: float) -> Breakdown:
    out = Breakdown(stage=k)
    P, how = _stage_params(model, layout, k)
    out.params = int(P)
    d, z = layout.data, layout.zero
    w, g, s = zero_bytes(P, precision, z, d)
    lines = out.lines
    lines.append(f"stage {k}: {how} = {P:.6g} parameters on this device")
    lines.append(f"  ZeRO {z} over d {d}: weights {precision.weight} B x P{' / d' if z >= 3 else ''} = {_b(w)}")
    lines.append(f"  gradients {precision.grad} B x P{' / d' if z >= 2 else ''} = {_b(g)}")
    lines.append(f"  optimizer state {precision.state} B x P{' / d' if z >= 1 else ''} = {_b(s)}")
    if extra_grad and z < 2:
        g += extra_grad * P
        lines.append(f"  + {extra_grad:g} B x P reduced gradient copy (implementation) = {_b(extra_grad * P)}")
    if extra_state and z in (1, 2):
        s += extra_state * P / d
        lines.append(f"  + {extra_state:g} B x P / d optimizer's copy of the weight slice (implementation) = "
                     f"{_b(extra_state * P / d)}")
    if z == 3 and isinstance(model, Transformer):
        gathered = 2 * model.layer_params() / layout.tensor * precision.weight
        w += gathered
        lines.append(f"  + 2 gathered layers (running + prefetched) x {model.layer_params()} / t x "
                     f"{precision.weight} B = {_b(gathered)}")
        whole_grad = model.layer_params() / layout.tensor * precision.grad
        g += whole_grad
        lines.append(f"  + 1 layer's whole gradients before their reduce-scatter x {model.layer_params()} / t x "
                     f"{precision.grad} B = {_b(whole_grad)}")
    out.weights, out.grads, out.state = w, g, s
    if isinstance(model, Transformer):
        out.activations = _activations(model, layout, precision, k, lines)
    lines.append(f"  total {_b(out.total)}")
    return out


def layer_activation_bytes(model: Transformer, layout: Layout, precision: Precision, *,
                           recompute: str | None = None) -> float:
    """One layer's stored activation bytes for one micro-batch (the module's formula)."""
    s, b, h, a, f = model.seq, layout.micro_batch, model.hidden, model.heads, model.f
    t, e = layout.tensor, precision.activation
    t_sp = t if layout.sequence_parallel else 1
    masks = 2 if model.dropout else 0
    rec = layout.recompute if recompute is None else recompute
    if rec == "full":
        return s * b * h * e / t_sp
    unsplit_n, split_n, per_f = KEPT[model.kept]
    unsplit = s * b * h * (unsplit_n * e + masks) / t_sp
    split = s * b * h * e * (split_n + per_f * f / h) / t
    scores = 0.0 if rec == "selective" else a * s * s * b * ((2 * e + 1) if model.dropout else e) / t
    return unsplit + split + scores


def _activations(model: Transformer, layout: Layout, precision: Precision, k: int, lines: list[str]) -> float:
    p, m = layout.pipeline, layout.microbatches
    in_flight = min(p - k, m)
    layers = _stage_layers(model, p, k)
    per_layer = layer_activation_bytes(model, layout, precision)
    total = layers * in_flight * per_layer
    s, b, h, a = model.seq, layout.micro_batch, model.hidden, model.heads
    lines.append(f"  activations, recompute {layout.recompute}: s {s} b {b} h {h} a {a} t {layout.tensor}, "
                 f"{precision.activation} B an element, {'with' if model.dropout else 'no'} dropout: "
                 f"{_b(per_layer)} a layer")
    lines.append(f"  x {layers} layers x {in_flight} micro-batches in flight = {_b(total)}")
    if layout.recompute == "full":
        rebuilt = (layer_activation_bytes(model, layout, precision, recompute="none")
                   - layer_activation_bytes(model, layout, precision, recompute="full"))
        total += rebuilt
        lines.append(f"  + one layer rebuilt in backward (less its input, counted above) = {_b(rebuilt)}")
    if k == p - 1:
        total += _top_bytes(model, layout, precision, lines)
    return total


def _top_bytes(model: Transformer, layout: Layout, precision: Precision, lines: list[str]) -> float:
    """The last stage's arrays above the layers: the logits for the loss (and, with Keras layers,
    the final LayerNormalization's; the module docstring)."""
    s, b, h, t = model.seq, layout.micro_batch, model.hidden, layout.tensor
    t_sp = t if layout.sequence_parallel else 1
    if model.kept == "megatron":
        logits = 4.0 * s * b * model.vocab / t
        lines.append(f"  + logits in fp32, 4 s b v / t = {_b(logits)}")
        return logits
    n_norm = 2 if layout.recompute == "full" else 3
    norm = n_norm * s * b * h * precision.activation / t_sp
    loss = 2 * 4.0 * s * b * model.vocab / t
    lines.append(f"  + final layernorm, {n_norm} x s b h x {precision.activation} B"
                 f"{' / t' if t_sp > 1 else ''} = {_b(norm)}")
    lines.append(f"  + the loss's exp and one-hot in fp32, 2 x 4 s b v / t = {_b(loss)}")
    return norm + loss


def _b(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"
