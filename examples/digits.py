"""The 8x8 handwritten digits the examples train on, shipped with the project (examples/data/digits.npz).

1797 images of 8 x 8 pixels, each pixel an integer 0..16 (how many of a 4 x 4 block of a 32 x 32
bitmap were on), and their digits 0..9: the test set of "Optical Recognition of Handwritten Digits"
(E. Alpaydin, C. Kaynak, 1998; UCI Machine Learning Repository, CC BY 4.0,
https://archive.ics.uci.edu/dataset/80), in the order and form scikit-learn's ``load_digits``
returns it. The file was written from scikit-learn 1.9.1's copy::

    python -c "import numpy as np; from sklearn.datasets import load_digits; d = load_digits(); \\
        np.savez_compressed('examples/data/digits.npz', pixels=d.data.astype(np.uint8), \\
                            labels=d.target.astype(np.uint8))"

so the examples no longer need scikit-learn. They did only for this, and Keras imports
scikit-learn whenever it is installed (its scikit-learn wrappers): 0.6-0.8 CPU-seconds of every
TensorFlow process's start, on this 2-core machine, for nothing. :func:`load` checks the file's
digest, so a damaged or different copy is an error, not other results.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FILE = Path(__file__).resolve().parent / "data" / "digits.npz"
SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"   # pixels' bytes, then labels'


def load() -> tuple[np.ndarray, np.ndarray]:
    """(data, target) as scikit-learn's ``load_digits()`` gives them: float64 (1797, 64) in 0..16, int64 (1797,)."""
    with np.load(FILE) as f:
        pixels, labels = f["pixels"], f["labels"]
    digest = hashlib.sha256(pixels.tobytes() + labels.tobytes()).hexdigest()
    if digest != SHA256 or pixels.shape != (1797, 64) or labels.shape != (1797,):
        raise ValueError(f"{FILE}: not the digits this project ships (sha256 {digest}, shapes {pixels.shape}, "
                         f"{labels.shape}); restore it with git checkout")
    return pixels.astype(np.float64), labels.astype(np.int64)


def split(seed: int):
    """(x_train, y_train, x_test, y_test): an 80/20 split of the shuffled digits, pixels in [0, 1]."""
    data, target = load()
    order = np.random.default_rng(seed).permutation(len(target))
    x = (data[order] / 16.0).astype(np.float32)
    y = target[order]
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]
