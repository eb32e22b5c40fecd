"""What a caller holds while the engine works: a :class:`Handle` (for a tensor, the engine's :class:`Entry`).

``allreduce_async`` returns a handle at once. The engine thread later sets
its result (or its error), and ``wait()`` returns (or raises) it::

    h = ar.allreduce_async(grad, name="layer1/w")
    ...                               # compute more gradients meanwhile
    avg = h.wait()                    # or ar.synchronize(h)

Do not modify the submitted array until the handle is done: the engine reads
it when the tensor is packed, as MPI does with the buffer of an ``Isend``.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..ops import Op
from .compression import Compression

__all__ = ["Handle", "GroupHandle", "GroupedHandle", "Entry", "Meta", "announce"]

#: What every rank must agree on for one name: (shape, dtype name, op, compressor name).
Meta = tuple


_NOBODY: frozenset = frozenset()
_NONE = Compression.none
_monotonic = time.monotonic          # module globals: one attribute lookup less per tensor

_DONE = threading.Condition()
"""Announces completed handles: every blocked :meth:`Handle.wait` sleeps on it and rechecks its own."""


def announce() -> None:
    """Wake every blocked :meth:`Handle.wait` to recheck its handle (after handles were completed)."""
    with _DONE:
        _DONE.notify_all()


_DTYPE_NAMES: dict = {}    # dtype -> its name: ``dtype.name`` is computed in Python (~5 us a call)


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


class Handle:
    """The future result of one asynchronous allreduce.

    Completion is a flag and one condition shared by every handle (:data:`_DONE`): a waiter
    sleeps on the condition until its handle's flag is set, and the engine announces once per
    finished batch, not once per tensor. A lock per handle, held from creation until the
    result was set, cost ~0.15 us per tensor (allocated, acquired, released); a
    ``threading.Event`` ~6 us.
    """

    __slots__ = ("name", "_done", "_result", "_error", "_on_wait")

    def __init__(self, name: str, on_wait=None):
        self.name = name
        self._on_wait = on_wait            # on_wait(+1) when a caller blocks on this handle, (-1) after
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the result (or an error) is available; never blocks."""
        return self._done

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done and return the reduced array (same shape and dtype as the input).

        Args:
            timeout: seconds to wait; ``None`` waits until the engine finishes or fails it.

        Returns:
            The result, bitwise identical on every rank.

        Raises:
            The error the engine failed this tensor with (``MismatchError``,
            ``CompressionError``, ``StallError``, ``ShutdownError``, ...), or
            ``TimeoutError`` if ``timeout`` passed first.
        """
        if not self._done:
            on_wait = self._on_wait
            if on_wait is not None:
                on_wait(1)
            try:
                self._block(timeout)
            finally:
                if on_wait is not None:
                    on_wait(-1)
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with _DONE:
            while not self._done:
                if deadline is None:
                    _DONE.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"allreduce of {self.name!r} not done after {timeout:g} s")
                _DONE.wait(left)

    def _set(self, result: Any) -> None:
        """Complete with ``result`` and wake the waiters. (A batch sets each handle's ``_result``
        and ``_done`` itself, then calls :func:`announce` once.)"""
        if not self._done:
            self._result = result
            self._done = True
            announce()

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            announce()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "pending"
        return f"<Handle {self.name!r} {state}>"


class GroupHandle:
    """The future results of a grouped allreduce: one engine tensor (the group's arrays packed
    back to back), so one negotiation bit and one result; ``wait()`` returns one view per array."""

    __slots__ = ("name", "_handle", "_shapes", "_bounds")

    def __init__(self, handle: Handle, shapes: list[tuple[int, ...]], sizes: list[int]):
        self.name, self._handle, self._shapes = handle.name, handle, shapes
        self._bounds = [0]                     # from the arrays' sizes: np.prod of a shape costs ~5 us
        for n in sizes:
            self._bounds.append(self._bounds[-1] + n)

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Block until done; return the reduced arrays, in submission order (views of one result)."""
        joint = self._handle.wait(timeout)
        b = self._bounds
        return [joint[b[i]:b[i + 1]].reshape(shape) for i, shape in enumerate(self._shapes)]

    def wait_packed(self, timeout: float | None = None) -> tuple[np.ndarray, list[int]]:
        """Block until done; return the flat result and each array's bounds in it (array i is
        ``joint[bounds[i]:bounds[i + 1]]``), for a caller that cuts it up itself (tfops: one
        ``tf.split`` instead of one tensor per array)."""
        return self._handle.wait(timeout), self._bounds

    def __repr__(self) -> str:
        return f"<GroupHandle {self.name!r} of {len(self._shapes)} arrays, {self._handle!r}>"


class GroupedHandle:
    """What ``grouped_allreduce_async`` returns: one engine tensor per dtype of the list (a
    :class:`GroupHandle`; Adasum: one :class:`Handle` per array), each with the positions of
    its arrays in the list. ``wait()`` returns the results in list order."""

    __slots__ = ("name", "_parts", "_count")

    def __init__(self, name: str | None, parts: list[tuple[list[int], Any]], count: int):
        self.name, self._parts, self._count = name, parts, count

    def done(self) -> bool:
        return all(h.done() for _, h in self._parts)

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Block until every part is done (``timeout`` applies to each); the reduced arrays, in order."""
        out: list = [None] * self._count
        for members, h in self._parts:
            results = h.wait(timeout)
            for i, result in zip(members, results if isinstance(h, GroupHandle) else [results]):
                out[i] = result
        return out

    def wait_packed(self, timeout: float | None = None) -> list[tuple[list[int], np.ndarray, list[int]]]:
        """Block until done; per part ``(positions in the list, flat result, bounds)``: see
        :meth:`GroupHandle.wait_packed` (an Adasum part is one array: bounds ``[0, size]``)."""
        packed = []
        for members, h in self._parts:
            if isinstance(h, GroupHandle):
                packed.append((members, *h.wait_packed(timeout)))
            else:
                flat = h.wait(timeout).reshape(-1)
                packed.append((members, flat, [0, flat.size]))
        return packed

    def __repr__(self) -> str:
        return f"<GroupedHandle {self.name!r} of {self._count} arrays in {len(self._parts)} part(s)>"


class Entry(Handle):
    """One submitted tensor inside the engine (owned by the engine thread after submit), and the
    :class:`Handle` its caller holds: one object a tensor, not two (a second object and its
    lock cost ~0.25 us of a ~2 us submit, for each of a training step's hundreds of tensors).
    The caller sees only the handle's methods."""

    __slots__ = ("array", "flat", "op", "compressor", "meta", "payload", "ctx",
                 "submitted", "announced", "seen", "locked", "inplace", "wire", "shares")

    def __init__(self, name: str, array: np.ndarray, op: Op, compressor, on_wait=None,
                 inplace: bool = False):
        # Handle.__init__, inlined (a call less per tensor)
        self._on_wait = on_wait
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self.name = name
        self.array = array
        self.op = op
        self.compressor = compressor
        self.inplace = inplace                   # the result goes into ``array`` itself
        self.payload: np.ndarray | None = None   # a custom compressor's output, made at drain time
        self.ctx: Any = None
        flags = array.flags                      # one flags object: each .flags makes a new one
        if flags.c_contiguous:
            # A 1-D array is its own flat form unless the result is written into it (in place:
            # ``flat`` must stay writeable while ``array`` is locked); reshape costs ~0.15 us.
            self.flat = array if array.ndim == 1 and not inplace else array.reshape(-1)
            self.shares = True                   # flat is the caller's memory (else a copy of it)
            # The engine reads the caller's memory only when every rank is ready, so a write in
            # between would change the result silently: make the array read-only until then
            # (a write raises "assignment destination is read-only"). A copy needs no lock.
            # setflags: half the cost of assigning flags.writeable (0.24 against 0.4 us, twice a tensor).
            self.locked = locked = flags.writeable
            if locked:
                array.setflags(write=False)
        else:
            self.flat = np.ascontiguousarray(array).reshape(-1)
            self.shares = self.locked = False
        dtype = array.dtype
        self.meta: Meta = (array.shape, _DTYPE_NAMES.get(dtype) or _dtype_name(dtype), op._value_,
                           compressor.name)
        # (dtype, count) on the wire: known now without compression, else at drain (fusion._wire)
        self.wire: tuple | None = (dtype, array.size) if compressor is _NONE else None
        self.submitted = _monotonic()
        self.announced = False                   # sent through the slow path (uncached names)
        self.seen: frozenset[int] = _NOBODY      # ranks known ready (timeline ticks)

    def output(self, flat_result: np.ndarray) -> np.ndarray:
        """Where an in-place result lives: ``flat`` when it is the caller's memory, else copied back."""
        if not self.shares:
            np.copyto(self.array, flat_result.reshape(self.array.shape))
        elif flat_result is not self.flat:
            np.copyto(self.flat, flat_result)
        return self.array

    def release(self) -> None:
        """Give the caller its array back (writeable again, if it was)."""
        if self.locked:
            self.locked = False
            try:
                self.array.setflags(write=True)
            except ValueError:                   # its base became read-only meanwhile: leave it
                pass
