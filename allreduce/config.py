"""All settings in one frozen dataclass. The environment is read once, here.

``Config.from_env(**overrides)`` is called by ``ar.init()``: every field can
come from an ``ALLREDUCE_*`` variable, and keyword arguments to ``init()``
override both. Nothing else in the library reads ``os.environ``.

=================================  ============================  ===========
variable                           field                         default
=================================  ============================  ===========
ALLREDUCE_ALGORITHM                algorithm                     auto
ALLREDUCE_CHECK                    check                         1
ALLREDUCE_SEGMENT_BYTES            segment_bytes                 262144
ALLREDUCE_TIMEOUT                  timeout                       30.0
ALLREDUCE_COSTMODEL                costmodel                     (per machine)
ALLREDUCE_FAKE_NODE_SIZE           fake_node_size                0 (off)
=================================  ============================  ===========

Later layers (the engine) add their fields here too, in the same table.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

__all__ = ["Config", "ALGORITHM_NAMES"]

#: Names accepted by ``algorithm=``; ``auto`` chooses among the others.
ALGORITHM_NAMES = ("auto", "ring", "tree", "rhd", "rd", "mpi", "shm", "hierarchical")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one communicator. Build it with :meth:`from_env`."""

    algorithm: str = "auto"          #: default algorithm for ``allreduce``
    check: bool = True               #: cross-rank metadata check before each collective
    segment_bytes: int = 256 << 10   #: pipeline segment of ring and tree
    timeout: float = 30.0            #: seconds a peer may be silent before an error
    costmodel: str = ""              #: path of fitted cost-model constants ("" = per machine cache)
    fake_node_size: int = 0          #: pretend nodes hold this many ranks (testing hierarchical)

    _ENV = {
        "algorithm": "ALLREDUCE_ALGORITHM",
        "check": "ALLREDUCE_CHECK",
        "segment_bytes": "ALLREDUCE_SEGMENT_BYTES",
        "timeout": "ALLREDUCE_TIMEOUT",
        "costmodel": "ALLREDUCE_COSTMODEL",
        "fake_node_size": "ALLREDUCE_FAKE_NODE_SIZE",
    }

    def __post_init__(self):
        if self.algorithm not in ALGORITHM_NAMES:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHM_NAMES)}; got {self.algorithm!r}")
        if self.segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {self.segment_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout}")
        if self.fake_node_size < 0:
            raise ValueError(f"fake_node_size must be >= 0, got {self.fake_node_size}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, then ``ALLREDUCE_*`` variables, then ``overrides``."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(fields))}")
        values: dict[str, Any] = {}
        for name, var in cls._ENV.items():
            if var in environ:
                values[name] = cls._parse(name, var, environ[var], fields[name])
        values.update(overrides)
        return cls(**values)

    @staticmethod
    def _parse(name: str, var: str, text: str, field: dataclasses.Field) -> Any:
        kind = field.type if isinstance(field.type, type) else eval(field.type)  # noqa: S307 - our own annotations
        try:
            if kind is bool:
                return _bool(text)
            return kind(text)
        except ValueError as exc:
            raise ValueError(f"{var}={text!r} is not a valid {name}: {exc}") from None
