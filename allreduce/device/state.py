"""Per-communicator device resources that the device paths reuse between calls.

:class:`_State` holds one communicator's CUDA streams, its pinned host buffer and its IPC maps;
:func:`_state` finds (or makes) the one for a workspace. Both :mod:`.dispatch` and :mod:`.ipc`
read it, so it lives here, below both of them.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from numba import cuda


class _State:
    """Per-communicator device resources, kept between calls: stream, pinned buffer, IPC maps."""

    def __init__(self):
        self.streams: dict[int, Any] = {}
        self.pinned: np.ndarray | None = None
        self.scratch: dict[int, Any] = {}        # device -> (IPC-exported device buffer, handle bytes)
        self.peers: dict[int, tuple] = {}        # peer rank -> (handle bytes, IPC handle, mapped array)

    def stream(self, device_id: int):
        if device_id not in self.streams:
            self.streams[device_id] = cuda.stream()
        return self.streams[device_id]

    def host(self, nbytes: int) -> np.ndarray:
        """Pinned (page-locked) host bytes, grown in powers of two: DMA needs no bounce copy."""
        if self.pinned is None or self.pinned.nbytes < nbytes:
            self.pinned = cuda.pinned_array(1 << max(12, (nbytes - 1).bit_length()), np.uint8)
        return self.pinned[:nbytes]


_STATES: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()


def _state(workspace) -> _State:
    if workspace not in _STATES:
        _STATES[workspace] = _State()
    return _STATES[workspace]
