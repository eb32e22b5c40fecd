"""What is trained: a parameter count, or a GPT-style transformer's shape, and the bytes per number.

A model is either ``Params(n)`` (only a count: enough for the ZeRO paper's table) or a
``Transformer`` (layers L, hidden h, heads a, sequence s, vocabulary v, MLP width f = 4h by
default), from which the planner also counts activations, flops and the per-layer messages of
tensor parallelism. A transformer layer holds

    attention   Q, K, V and the output projection   4h^2 + 4h
    MLP         h -> f -> h                         2hf + f + h
    2 layernorms                                    4h
    -----------------------------------------------------------
    f = 4h:                                         12h^2 + 13h

and the embedding v*h (tied to the output layer, as GPT-2 and Megatron tie it) plus s*h
positions. Megatron's 8.3 B (72 x 3072, v = 51200, s = 1024): 72 (12 * 3072^2 + 13 * 3072)
+ 51200 * 3072 + 1024 * 3072 = 8.317e9.

``Precision``: bytes per parameter of the weights, the gradients and the optimizer state
(Adam), and of one activation element. Mixed-precision Adam (the ZeRO paper's K = 12) keeps
fp16 weights and gradients (2 + 2) and an fp32 master copy, m and v (4 + 4 + 4): 16 bytes.
Plain fp32 Adam keeps 4 + 4 + 8, also 16, with no master copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Params", "Transformer", "Precision", "PRECISIONS", "PRESETS"]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (weight, gradient, optimizer state) and per activation element."""

    name: str
    weight: int
    grad: int
    state: int           #: optimizer state per parameter: Adam m and v, plus a master copy if any
    activation: int      #: bytes per stored activation element (2 in fp16/bf16, 4 in fp32)
    master: int = 0      #: of ``state``, the bytes of the optimizer's own weight copy (fp32 master)

    @property
    def per_param(self) -> int:
        return self.weight + self.grad + self.state


PRECISIONS = {
    # Rajbhandari et al. 2019 (ZeRO), section 3.1: fp16 weights and gradients, fp32 master, m, v
    "mixed": Precision("mixed", 2, 2, 12, 2, master=4),
    # float32 everywhere, Adam's m and v: what this project's examples train with
    "fp32": Precision("fp32", 4, 4, 8, 4),
}


@dataclass(frozen=True)
class Params:
    """A model known only by its parameter count (no activations, no layers)."""

    count: int
    name: str = "model"

    @property
    def params(self) -> int:
        return int(self.count)

    def describe(self) -> str:
        return f"{self.name}: {_count(self.params)} parameters"


@dataclass(frozen=True)
class Transformer:
    """A GPT-style decoder: ``layers`` blocks of ``hidden`` width with ``heads`` heads."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0                   #: MLP width; 0: 4 * hidden
    dropout: bool = True           #: dropout masks are kept for backward (1 byte an element)
    tied: bool = True              #: the output layer reuses the embedding
    kept: str = "megatron"         #: what the layer keeps for backward (memory.KEPT): "megatron" or "keras"
    name: str = "transformer"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"a transformer needs {name} >= 1, got {getattr(self, name)}")
        if self.kept not in ("megatron", "keras"):
            raise ValueError(f"kept is 'megatron' or 'keras', got {self.kept!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} does not divide into {self.heads} heads")

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    def layer_params(self) -> int:
        h, f = self.hidden, self.f
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def embedding_params(self) -> int:
        """Token and position embeddings (a tied output layer adds nothing)."""
        return self.vocab * self.hidden + self.seq * self.hidden

    def head_params(self) -> int:
        """The output layer's own weights: none when tied, else v*h; plus the final layernorm."""
        return (0 if self.tied else self.vocab * self.hidden) + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def forward_flops(self, batch: int) -> float:
        """Multiply-adds x 2 of one forward pass over ``batch`` sequences: every layer's matrices
        (2 * tokens * (4h^2 + 2hf)), its attention scores and their use (2 * 2 * b s^2 h), and the
        logits (2 * tokens * h * v). Narayanan et al. 2021, eq. 3, with f = 4h."""
        s, h = self.seq, self.hidden
        tokens = batch * s
        per_layer = 2 * tokens * (4 * h * h + 2 * h * self.f) + 4 * batch * s * s * h
        return self.layers * per_layer + 2 * tokens * h * self.vocab

    def attention_core_flops(self, batch: int) -> float:
        """Of one layer's forward flops, the part selective recompute runs again: QK^T and AV."""
        return 4.0 * batch * self.seq * self.seq * self.hidden

    def layer_tensors(self) -> int:
        """Weight tensors of one layer: two layernorms (scale, bias), the attention's projections
        and the MLP's two matrices, each with a bias: 12 with a fused QKV (Megatron), 16 with
        separate Q, K and V (Keras' MultiHeadAttention)."""
        return 16 if self.kept == "keras" else 12

    def edge_tensors(self) -> tuple[int, int]:
        """Weight tensors outside the layers: (first stage: token and position embeddings; last
        stage: the final layernorm's two and, untied, the output layer's kernel and bias)."""
        return 2, 2 + (0 if self.tied else 2)

    def edge_units(self) -> tuple[int, int]:
        """Units of ZeRO 3 outside the layers (each gathered and reduce-scattered on its own):
        (first stage, last stage). Keras layers (tfops' ``fully_shard`` wraps every layer that
        holds weights, examples/gpt.py): the token and the position embeddings, the final
        layernorm and, untied, the head; Megatron's: the embedding and the head."""
        return (2, 1 + (0 if self.tied else 1)) if self.kept == "keras" else (1, 1)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"sequence {self.seq}, vocabulary {self.vocab}: {_count(self.params)} parameters")


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return str(int(n))


#: Models the lesson walks through, with where their shapes come from.
PRESETS = {
    # Shoeybi et al. 2019 (Megatron-LM), Table 1: 8.3 B on 512 V100 32 GB, 8-way model x 64-way data
    "megatron-8.3b": Transformer(72, 3072, 32, 1024, 51200, name="Megatron GPT-2 8.3B",
                                 notes=("Shoeybi et al. 2019, Table 1: 512 V100 32 GB, tensor 8 x data 64, "
                                        "global batch 512",)),
    # Narayanan et al. 2021, Table 1: 1 T on 3072 A100 80 GB, tensor 8, pipeline 64, batch 3072
    "gpt-1t": Transformer(128, 25600, 160, 2048, 51200, name="GPT 1T",
                          notes=("Narayanan et al. 2021, Table 1: 3072 A100 80 GB, tensor 8 x pipeline 64, "
                                 "global batch 3072",)),
}
