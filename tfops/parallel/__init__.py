"""tfops.parallel: model parallelism for Keras 3 on TensorFlow (issue 42 onwards).

``Mesh`` (:mod:`.mesh`) lays the ranks out on tensor, data and pipeline axes and owns each axis's
process sets; layers and schedules take a mesh, and nothing else knows how ranks map to axes.
"""
from __future__ import annotations

from .errors import MeshError, MismatchError, ShapeError
from .mesh import Mesh
from .pipeline import Pipeline              # issue 43: pipeline parallelism (schedules in allreduce/schedules)
from .pipeline_model import PipelineModel

__all__ = ["Mesh", "Pipeline", "PipelineModel", "MeshError", "ShapeError", "MismatchError"]
