"""ResNet-50's trainable parameter tensors, written out from the architecture.

He et al., "Deep Residual Learning for Image Recognition" (2015), Table 1,
in torchvision's layout: convolutions without bias, each followed by a
batch norm with a weight and a bias, a 1x1 projection ("downsample") on the
first block of every stage, and a 1000-way classifier. 53 convolutions +
53 x 2 batch-norm vectors + 2 classifier tensors = 161 tensors holding
25,557,032 float32 values (torchvision's published count for resnet50).
This is the gradient list one training step allreduces.

:func:`keras_shapes` is the same network as ``keras.applications.ResNet50`` holds it: every
convolution ``(kh, kw, in, out)`` with a bias of its own (Keras' ``Conv2D`` default), the
classifier ``(in, out)``: 214 tensors, 25,583,592 values. A communication hook views each as
a matrix of its last dimension (output channels) against the rest.
"""
from __future__ import annotations

import math

__all__ = ["SHAPES", "TOTAL", "shapes", "keras_shapes"]

_STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))    # (bottleneck width, blocks) of conv2_x .. conv5_x
_EXPANSION = 4                                       # a bottleneck's output is 4x its width


def _bn(name: str, channels: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{name}.weight", (channels,)), (f"{name}.bias", (channels,))]


def shapes(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of every trainable tensor, in forward order."""
    out = [("conv1.weight", (64, 3, 7, 7))] + _bn("bn1", 64)
    inplanes = 64
    for stage, (width, blocks) in enumerate(_STAGES, start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            out += [(f"{prefix}.conv1.weight", (width, inplanes, 1, 1))] + _bn(f"{prefix}.bn1", width)
            out += [(f"{prefix}.conv2.weight", (width, width, 3, 3))] + _bn(f"{prefix}.bn2", width)
            out += [(f"{prefix}.conv3.weight", (width * _EXPANSION, width, 1, 1))]
            out += _bn(f"{prefix}.bn3", width * _EXPANSION)
            if block == 0:      # the projection shortcut: channels (and stride) change here
                out += [(f"{prefix}.downsample.0.weight", (width * _EXPANSION, inplanes, 1, 1))]
                out += _bn(f"{prefix}.downsample.1", width * _EXPANSION)
            inplanes = width * _EXPANSION
    out += [("fc.weight", (num_classes, inplanes)), ("fc.bias", (num_classes,))]
    return out


SHAPES = shapes()
TOTAL = sum(math.prod(shape) for _, shape in SHAPES)   #: 25,557,032


def keras_shapes(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of ``keras.applications.ResNet50(weights=None)``'s trainable
    tensors: :func:`shapes` in Keras' layout, a bias per convolution, in :func:`shapes`' order
    (Keras builds a stage's first block in another order: the same 214 shapes, a few swapped)."""
    out = []
    for name, shape in shapes(num_classes):
        if len(shape) == 4:                     # (out, in, kh, kw) -> (kh, kw, in, out), and its bias
            o, i, kh, kw = shape
            out += [(name, (kh, kw, i, o)), (name[:-len("weight")] + "bias", (o,))]
        elif name == "fc.weight":
            out.append((name, shape[::-1]))
        else:
            out.append((name, shape))
    return out
