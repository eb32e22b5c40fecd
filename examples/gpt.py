"""A GPT-2-style language model split with Megatron's tensor parallelism (tfops.parallel), trained on
the project's own lessons at character level.

    python examples/gpt.py --quick                                       # one process
    mpirun -np 2 python examples/gpt.py --tensor 2 --quick               # heads and MLP split in two
    mpirun -np 4 python examples/gpt.py --tensor 2 --data 2 --quick      # ... and the batch split in two
    mpirun -np 4 python examples/gpt.py --tensor 4 --sequence-parallel --quick
    mpirun -np 8 python examples/gpt.py --tensor 2 --pipeline 2 --quick   # 2 x 2 x 2 (examples/gpt_pipeline.py)

The model (pre-LayerNorm, no dropout, untied head)::

    ids ─> VocabParallelEmbedding + position embedding
        ─> N x [ x + ParallelMultiHeadAttention(LN(x)) ;  x + RowParallelDense(ColumnParallelDense(LN(x), gelu)) ]
        ─> LN ─> ColumnParallelDense(vocab) ─> vocab_parallel_cross_entropy

``GPT(config, mesh)`` builds the split model; ``GPT(config, None, plain=True)`` the same model from
plain Keras layers (Embedding, MultiHeadAttention, Dense). ``full_weights`` / ``load_full_weights``
move weights between the two at any tensor size. The vocabulary is padded to a multiple of 64
whatever the tensor size, so a checkpoint fits every tensor size up to 64 (Megatron pads it too).

With ``--sequence-parallel`` the activations between the blocks are split along the sequence; the
LayerNorms' and position embedding's gradients, then partial on each rank, are summed over the
tensor group in one allreduce per step (``tfops.parallel.allreduce_sequence_parallel_gradients``).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tfops  # noqa: E402
from tfops import parallel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD_VOCAB_TO = 64


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    vocab: int = 128                   # padded vocabulary (a multiple of PAD_VOCAB_TO)
    sequence_parallel: bool = False
    init: str = "sliced"               # or "per_rank": no rank ever holds a full matrix (tfops.parallel.init)


def text_and_vocab() -> tuple[np.ndarray, int]:
    """The lessons (docs/*.md, in name order) as character ids, and the padded vocabulary size."""
    text = "".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int32), -(-len(chars) // PAD_VOCAB_TO) * PAD_VOCAB_TO


def batch(ids: np.ndarray, step: int, rows: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: ``rows`` windows of ``seq + 1`` characters (the same on every rank)."""
    starts = np.random.default_rng(step).integers(0, len(ids) - seq - 1, rows)
    windows = np.stack([ids[s:s + seq + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


class Block(keras.layers.Layer):
    def __init__(self, cfg: Config, mesh, plain: bool, **kwargs):
        super().__init__(**kwargs)
        sp, h = cfg.sequence_parallel, cfg.hidden
        self.ln1, self.ln2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
        self.plain = plain
        if plain:
            self.attn = keras.layers.MultiHeadAttention(cfg.heads, h // cfg.heads)
            self.up, self.down = keras.layers.Dense(4 * h, activation="gelu"), keras.layers.Dense(h)
        else:
            self.attn = parallel.ParallelMultiHeadAttention(cfg.heads, h // cfg.heads, mesh, causal=True,
                                                            sequence_parallel=sp, init=cfg.init)
            self.up = parallel.ColumnParallelDense(4 * h, mesh, activation="gelu", sequence_parallel=sp,
                                                   init=cfg.init)
            self.down = parallel.RowParallelDense(h, mesh, sequence_parallel=sp, init=cfg.init)

    def call(self, x):
        a = self.ln1(x)
        x = x + (self.attn(a, a, use_causal_mask=True) if self.plain else self.attn(a, a))
        return x + self.down(self.up(self.ln2(x)))


class GPT(keras.Model):
    """The model; ``plain=True`` builds it from Keras's own layers (the single-process reference)."""

    def __init__(self, cfg: Config, mesh=None, plain: bool = False):
        super().__init__()
        self.cfg, self.plain = cfg, plain
        self.mesh = parallel.init.LOCAL if plain else parallel.init.mesh_or_default(mesh)
        sp = cfg.sequence_parallel and not plain
        if plain:
            self.tok = keras.layers.Embedding(cfg.vocab, cfg.hidden)
            self.head = keras.layers.Dense(cfg.vocab, use_bias=False)
        else:
            self.tok = parallel.VocabParallelEmbedding(cfg.vocab, cfg.hidden, self.mesh, sequence_parallel=sp,
                                                       init=cfg.init)
            self.head = parallel.ColumnParallelDense(cfg.vocab, self.mesh, use_bias=False, sequence_parallel=sp,
                                                     init=cfg.init)
        self.pos = keras.layers.Embedding(cfg.seq, cfg.hidden)
        self.blocks = [Block(cfg, self.mesh, plain) for _ in range(cfg.layers)]
        self.ln_f = keras.layers.LayerNormalization()

    def call(self, ids):
        x = self.tok(ids)                                         # (b, s, h), or (b, s/t, h) sequence-parallel
        seq = self.cfg.seq // self.mesh.tensor if self.cfg.sequence_parallel and not self.plain else self.cfg.seq
        positions = tf.range(seq) + seq * (self.mesh.tensor_rank if self.cfg.sequence_parallel else 0)
        x = x + self.pos(positions)[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                             # (b, s, vocab) or this rank's (b, s, vocab/t)

    def loss_of(self, logits, labels):
        if self.plain:
            per_token = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        else:
            per_token = parallel.vocab_parallel_cross_entropy(logits, labels, self.mesh)
        return tf.reduce_mean(per_token)

    def layer_list(self) -> list:
        """Every weight-holding layer, in one order for the plain and the split model."""
        out = [self.tok, self.pos]
        for b in self.blocks:
            out += [b.ln1, b.attn, b.ln2, b.up, b.down]
        return out + [self.ln_f, self.head]

    def sequence_parallel_weights(self) -> list:
        """Replicated weights that see only this rank's part of the sequence under sequence parallelism:
        the position embedding, the LayerNorms, and the split layers' replicated biases."""
        lns = [self.ln_f] + [ln for b in self.blocks for ln in (b.ln1, b.ln2)]
        split = [w for layer in self.layer_list() for w in getattr(layer, "sequence_parallel_weights", [])]
        return [w for layer in [self.pos] + lns for w in layer.trainable_weights] + split


def full_weights(model: GPT) -> list:
    return [layer.get_weights() if model.plain or not hasattr(layer, "get_full_weights")
            else layer.get_full_weights() for layer in model.layer_list()]


def load_full_weights(model: GPT, weights: list) -> None:
    for layer, w in zip(model.layer_list(), weights):
        (layer.set_weights if model.plain or not hasattr(layer, "set_full_weights") else layer.set_full_weights)(w)


def build(cfg: Config, mesh=None, plain: bool = False, seed: int = 0) -> GPT:
    keras.utils.set_random_seed(seed)
    model = GPT(cfg, mesh, plain)
    model(np.zeros((1, cfg.seq), np.int32))        # build (collective for the split model: every rank builds)
    return model


def train_step_fn(model: GPT, optimizer, mesh, data_set=None):
    """One tf.function step: forward, the loss, gradients averaged over the data axis, Adam.

    Every gradient is dense, the embeddings' too (``sparse_as_dense``). Keras 3's Adam squares an
    ``IndexedSlices`` gradient row by row, before rows with the same index are summed: a gradient
    allgathered over the data axis repeats each position embedding row once per data rank, so its
    second moment came out as the sum of the squared halves instead of the square of the sum, and
    tensor 2 x data 2 departed from the single process at step 1 (2e-4..2e-3 relative). Dense, the
    update no longer depends on how the batch is split."""
    sp = model.cfg.sequence_parallel and not model.plain
    sp_weights = model.sequence_parallel_weights() if sp else []

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.loss_of(model(x), y)
        if data_set is not None:
            tape = tfops.DistributedGradientTape(tape, process_set=data_set, sparse_as_dense=True)
        variables = model.trainable_variables
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in tape.gradient(loss, variables)]
        grads = parallel.allreduce_sequence_parallel_gradients(grads, variables, sp_weights, model.mesh)
        optimizer.apply_gradients(zip(grads, variables))
        return loss
    return step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--data", type=int, default=None, help="default: size / tensor")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--init", choices=("sliced", "per_rank"), default="sliced",
                    help="sliced: every rank draws each full matrix and keeps its slice (tensor 1, 2, 4 start "
                         "equal); per_rank: each rank draws only its slice (for models too big to draw whole)")
    ap.add_argument("--quick", action="store_true", help="60 steps of the default model")
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline stages (examples/gpt_pipeline.py)")
    ap.add_argument("--micro-batches", type=int, default=4, help="with --pipeline")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b", help="with --pipeline")
    args = ap.parse_args(argv)
    tfops.init()
    mesh = parallel.Mesh(tensor=args.tensor, pipeline=args.pipeline)
    if args.data is not None and args.data != mesh.data:
        raise SystemExit(f"--data {args.data}: with {tfops.size()} ranks and --tensor {args.tensor} data is {mesh.data}")
    ids, vocab = text_and_vocab()
    cfg = Config(args.layers, args.hidden, args.heads, args.seq, vocab, args.sequence_parallel, args.init)
    steps = 60 if args.quick else args.steps
    model = build(cfg, mesh)
    optimizer = keras.optimizers.Adam(args.lr)
    if args.pipeline > 1:                               # the blocks cut into stages: examples/gpt_pipeline.py
        from gpt_pipeline import pipeline_of
        pipe = pipeline_of(model, mesh, micro_batches=args.micro_batches, schedule=args.schedule)
        step = lambda x, y: pipe.train_step(x, y, optimizer)    # noqa: E731 (the mean loss, on every rank)
    else:
        step = train_step_fn(model, optimizer, mesh, mesh.data_set if mesh.data > 1 else None)
    rows = args.batch // mesh.data
    start = time.perf_counter()
    for i in range(steps):
        x, y = batch(ids, i, args.batch, cfg.seq)
        mine = slice(mesh.data_rank * rows, (mesh.data_rank + 1) * rows)
        loss = float(step(x[mine], y[mine]))
        if mesh.data > 1:
            loss = float(tfops.allreduce(tf.constant(loss), process_set=mesh.data_set))
        if tfops.rank() == 0 and (i % 10 == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {loss:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    if tfops.rank() == 0:
        print(f"{mesh}: {steps} steps, final loss {loss:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
