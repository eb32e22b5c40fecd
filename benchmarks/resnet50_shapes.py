"""ResNet-50's trainable parameter tensors, written out from the architecture.

He et al., "Deep Residual Learning for Image Recognition" (2015), Table 1,
in torchvision's layout: convolutions without bias, each followed by a
batch norm with a weight and a bias, a 1x1 projection ("downsample") on the
first block of every stage, and a 1000-way classifier. 53 convolutions +
53 x 2 batch-norm vectors + 2 classifier tensors = 161 tensors holding
25,557,032 float32 values (torchvision's published count for resnet50).
This is the gradient list one training step allreduces.
"""
from __future__ import annotations

import math

__all__ = ["SHAPES", "TOTAL", "shapes"]

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
