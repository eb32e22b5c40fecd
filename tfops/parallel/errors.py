"""The errors tfops.parallel raises (one place, as STYLE.md asks).

Each is also a ``ValueError`` and a ``tf.errors.InvalidArgumentError`` (through
:class:`tfops.errors.InvalidArgumentError`), so ``except ValueError`` catches it, and every
rank raises it alike: the checks that raise them either compare values every rank already
holds (the world size, the mesh sizes after one allgather) or allgather the shapes first.
"""
from __future__ import annotations

from ..errors import InvalidArgumentError, MismatchError

__all__ = ["MeshError", "ShapeError", "MismatchError"]


class MeshError(InvalidArgumentError):
    """Mesh sizes that do not divide the world, or that differ between ranks."""


class ShapeError(InvalidArgumentError):
    """A size the tensor axis does not divide (hidden units, heads), or full weights of the wrong shape."""
