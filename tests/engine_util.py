"""Helpers for the engine tests: p engines as p threads over one ThreadWorld."""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from allreduce.config import Config
from allreduce.engine import Engine
from allreduce.transport.threads import ThreadWorld


@contextlib.contextmanager
def engines(p: int, **settings):
    """Start ``p`` engines (cycle 0.5 ms unless given); shut them down and check no thread is left."""
    settings.setdefault("cycle_time", 0.5)
    world = ThreadWorld(p, timeout=30)
    config = Config(**settings)
    started = [Engine(world.transport(r), config=config) for r in range(p)]
    try:
        yield started
    finally:
        for engine in started:
            engine.shutdown(timeout=20)
        assert not any(e.alive for e in started), "an engine thread is still alive after shutdown"
        assert not [t for t in threading.enumerate() if t.name.startswith("allreduce-engine")]


def submit_all(engs, tensors: dict[str, list[np.ndarray]], rng: np.random.Generator | None = None, **kwargs):
    """Every rank submits every tensor, each rank in its own random order; return {name: [handle per rank]}."""
    handles: dict[str, list] = {name: [None] * len(engs) for name in tensors}
    for r, engine in enumerate(engs):
        names = list(tensors)
        if rng is not None:
            rng.shuffle(names)
        for name in names:
            handles[name][r] = engine.submit(tensors[name][r], name=name, **kwargs)
    return handles


def wait_all(handles: dict[str, list], timeout: float = 30) -> dict[str, list[np.ndarray]]:
    return {name: [h.wait(timeout) for h in hs] for name, hs in handles.items()}
