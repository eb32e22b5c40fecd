"""What an elastic job keeps in memory so it can lose a rank and go on (Horovod's ``State``).

::

    step:    ... compute  allreduce  update | commit() | compute  allreduce  update | commit() ...
                                              save a copy                     save a copy
    a rank dies here ------------------------------------------------^
    survivors: restore()  -> the copy of the last commit, on every survivor
               (run() shrinks the world and rebuilds the library, then)
               reset callbacks -> sync() from the new rank 0 -> the step after the commit again

``commit()`` is a local copy, no message: its cost is one copy of the state
per commit (the model's bytes plus the optimizer's), and what a death costs is
the work done since the last one. ``sync()`` is a broadcast from rank 0; it runs
at every (re)start of :func:`~allreduce.elastic.run`, so every rank starts from
rank 0's state, bitwise.

:class:`State` is the base (subclasses say what ``save``, ``restore`` and
``sync`` copy); :class:`ObjectState` keeps keyword attributes, any picklable
Python values (an epoch counter, a batch index, a numpy array of weights).

The attributes of a state belong to its user: the library keeps its own
bookkeeping in underscore names only (``_commits``, ``_in_run``, as Horovod
keeps ``_reset_callbacks`` and ``_host_messages``), so a keyword such as
``commits=0`` or ``epoch=0`` is the user's counter, changed only by the user and
carried through commit, restore and sync as it is. A keyword that would hide a
method or an attribute the state already has (``commit``, ``sync``,
``_commits``) is a ``ValueError``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

__all__ = ["State", "ObjectState"]


class State:
    """The base of every elastic state: commit, restore, sync and the reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self):
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0         # commits made (the first sync counts as none), for describe()
        self._in_run = False      # inside elastic.run (only there may a commit start a regrow)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every recovery, before the state is synced:
        the place to re-shard data or rescale the learning rate for the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called by :func:`~allreduce.elastic.run` after a recovery)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory: a death after this point loses only the work done since.

        Inside :func:`~allreduce.elastic.run`, when the world is smaller than ``--max-np``
        (and spawning has not failed before), it then raises ``HostsUpdatedInterrupt`` on
        every rank alike (they all know the size): ``run`` spawns replacements and goes on
        from this commit (Horovod's ``check_host_updates``)."""
        self.save()
        self._commits += 1
        if self._in_run:
            _check_regrow()

    def describe(self) -> str:
        """The last commit in words, for the message of a job that stops (``commit 12 (epoch=1, batch=4)``)."""
        return f"commit {self._commits}"

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Hook for subclasses: rebuild what depends on the world size (before the callbacks)."""


def _check_regrow() -> None:
    from .. import api
    from ..errors import HostsUpdatedInterrupt
    from . import world
    config = api.communicator().config
    if config.elastic and api.size() < config.elastic_max_np and not world.regrow_failed:
        raise HostsUpdatedInterrupt(f"rank {api.rank()}: the world can grow from {api.size()} to "
                                    f"--max-np {config.elastic_max_np} ranks; elastic.run spawns them")


def _broadcast_object(obj: Any) -> Any:
    from .. import api
    return api.broadcast_object(obj, 0)


class ObjectState(State):
    """Keyword attributes as elastic state: ``state = ObjectState(epoch=0, batch=0, w=np.zeros(4))``.

    ``state.epoch`` and friends are ordinary attributes; :meth:`commit` copies
    their values, :meth:`restore` puts the copies back, :meth:`sync` broadcasts
    them from rank 0 (pickled: any picklable value).
    """

    def __init__(self, **kwargs: Any):
        super().__init__()                               # first: the user's keywords are set last
        self._saved_state: dict[str, Any] = {}
        for name in kwargs:
            if hasattr(self, name):
                raise ValueError(f"{type(self).__name__}({name}=...): {name!r} is taken by the state "
                                 f"itself ({'its bookkeeping' if name.startswith('_') else 'a method'}); "
                                 "rename the attribute")
        self._saved_state = {k: copy.deepcopy(v) for k, v in kwargs.items()}
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))    # a later in-place change must not touch the commit

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:                            # rank 0's last commit (or its starting values)
            self._saved_state, self._commits = _broadcast_object((self._saved_state, self._commits))
            self._set_attrs()

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self._saved_state.items()
                          if isinstance(v, (int, float, str)) and not isinstance(v, bool))
        return f"commit {self._commits}" + (f" ({shown})" if shown else "")
