"""Elastic training with TensorFlow: Horovod's ``hvd.elastic`` on :mod:`allreduce.elastic`.

Two files: ``recovery.py`` (``run``: a peer's death seen through TensorFlow's errors, and what
``tfops.init`` redoes after the world is rebuilt) and ``state.py`` (``TensorFlowState``,
``TensorFlowKerasState``: what a commit keeps). ``tfops.keras.elastic`` adds the Keras callbacks;
``tfops/sharding/elastic.py`` is how a ``ShardedOptimizer`` commits.

::

    import tfops as hvd
    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                train_step(...)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

A state holds, besides its keyword attributes (``epoch``, ``batch``, any
picklable value), the model's weights and the optimizer's variables (Keras 3:
``optimizer.variables``, the iteration count and every slot such as momentum).
``commit()`` copies them to host memory (one ``numpy()`` per variable),
``restore()`` assigns the copies back, ``sync()`` broadcasts rank 0's.
"""
from __future__ import annotations

from allreduce.elastic import HostsUpdatedInterrupt, ObjectState, State

from .recovery import is_peer_failure, run
from .state import TensorFlowKerasState, TensorFlowState

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState", "HostsUpdatedInterrupt",
           "is_peer_failure"]
