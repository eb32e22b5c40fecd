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
ALLREDUCE_LINK                     link (rate[,latency])         "" (measured when the job spans nodes)
ALLREDUCE_SHM_P2P                  shm_p2p                       1 (0 under --mca btl without sm)
ALLREDUCE_ENGINE                   engine                        1
ALLREDUCE_CYCLE_TIME               cycle_time (milliseconds)     1.0
ALLREDUCE_FUSION_THRESHOLD         fusion_threshold (bytes)      134217728
ALLREDUCE_CACHE_CAPACITY           cache_capacity                1024
ALLREDUCE_STALL_CHECK_TIME         stall_check_time (seconds)    60.0 (0: off)
ALLREDUCE_STALL_SHUTDOWN_TIME      stall_shutdown_time (seconds) 600.0 (0: never)
ALLREDUCE_OUT_OF_STEP_TIME         out_of_step_time (seconds)    5.0 (0: off)
ALLREDUCE_TIMELINE                 timeline (path)               "" (off)
ALLREDUCE_DEVICE                   device (CUDA device id)       -1 (local_rank % GPUs)
ALLREDUCE_CUDA_IPC                 cuda_ipc                      0
ALLREDUCE_CUDA_AWARE_MPI           cuda_aware_mpi                auto (1 / 0 force)
ALLREDUCE_ELASTIC                  elastic                       0 (allreduce-run --elastic sets 1)
ALLREDUCE_ELASTIC_MIN_NP           elastic_min_np                1 (--min-np)
ALLREDUCE_ELASTIC_MAX_NP           elastic_max_np                0 (--max-np: regrow up to it; 0: no regrow)
ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT elastic_recovery_timeout      120.0 (seconds per recovery step; 0: no bound)
ALLREDUCE_ELASTIC_RESET_LIMIT      elastic_reset_limit           -1 (--reset-limit: shrinks and regrows allowed; -1: any)
ALLREDUCE_ELASTIC_HANG_TIMEOUT     elastic_hang_timeout          0 (seconds a rank may be silent before eviction; 0: timeout)
=================================  ============================  ===========

The engine settings (``ar.allreduce_async`` and named ``ar.allreduce``; see
``allreduce/engine/``):

* ``engine``: start the background engine thread in ``init()``. It needs
  MPI thread level MULTIPLE (mpi4py's default); set 0 to run without it.
* ``cycle_time``: the longest time between two negotiation cycles (when
  the ranks agree which named tensors are ready everywhere). A burst of
  submits starts a cycle sooner, once submits pause for 0.2 x
  ``cycle_time``; after 20 empty cycles they stretch to 10 x. Shorter: less
  latency, more idle CPU.
* ``fusion_threshold``: the most bytes fused into one allreduce; 0 turns
  fusion off. 128 MiB (Horovod's default too) was fastest or tied for
  ResNet-50's 161 gradients at -np 2 on the 2-core dev VM:
  ``mpirun -np 2 python tests/mpi/engine_fusion_sweep.py --steps 8``
  (1, 4, 16, 32, 64, 128 MiB; with ``--backward-ms 300`` all tied).
* ``cache_capacity``: names remembered by the response cache (each one
  then costs 8 bytes per cycle instead of a gather of its name); more
  names than this keep working, on the slower path.
* ``stall_check_time``: rank 0 warns about tensors that some ranks
  submitted and others did not, naming both, after this many seconds.
* ``stall_shutdown_time``: after this many seconds such tensors fail with
  ``StallError`` on every rank instead of hanging.
* ``out_of_step_time``: when every rank has waited this long for a name
  that another rank has not submitted (each waits for a different tensor,
  so none can go on), every such name fails with ``StallError`` on every
  rank, saying the ranks are out of step. A blocking call (tfops, a named
  ``ar.allreduce``) never leaves that state by itself. A program that
  submits ``allreduce_async`` in different orders on different ranks, with
  more than this many seconds of work between its submits, passes through
  it legitimately: raise this setting or set 0 (then only
  ``stall_shutdown_time`` ends a stall).
* ``elastic_recovery_timeout``: under ``allreduce-run --elastic``, the longest
  one step of a recovery or a regrow (revoke, shrink, the rebuild, spawn,
  merge) may block inside MPI. Past it the job aborts, naming the step
  (``allreduce/elastic/watchdog.py``; a regrow's spawn or merge is revoked
  first and the job goes on at its size). Shrink takes well under a second;
  a spawn waits for the replacements' start-up and imports (10-20 s with
  TensorFlow on a loaded 2-core machine), so raise it if your script does
  much before ``ar.init()``.
* ``elastic_hang_timeout``: under ``allreduce-run --elastic``, how long a rank
  may go without a heartbeat (stopped, hung, swapping) before the others have
  the launcher SIGKILL it and recover without it (``allreduce/elastic/heartbeat.py``);
  0 means ``timeout``. Shorter: faster recovery, more false evictions of a
  rank that was only slow.
* ``timeline``: write a Chrome-trace JSON timeline; rank 0 writes this path,
  rank r writes ``<stem>.rank<r><suffix>`` next to it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

__all__ = ["Config", "ALGORITHM_NAMES", "ENV_VARIABLES"]

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
    autotune: bool = True            #: auto times the model's best few on each size's first calls (MPI)
    fake_node_size: int = 0          #: pretend nodes hold this many ranks (testing hierarchical)
    link: str = ""                   #: the inter-node link for auto, "10gbit" or "0.96gbit,31us" ("": measure it)
    shm_p2p: bool = True             #: one node: small swaps (rd, tree at p = 2) through shared mailboxes
    engine: bool = True              #: start the engine thread in init()
    cycle_time: float = 1.0          #: engine cycle, milliseconds
    fusion_threshold: int = 128 << 20  #: most bytes in one fused allreduce (0: no fusion)
    cache_capacity: int = 1024       #: names in the engine's response cache
    stall_check_time: float = 60.0   #: seconds before warning about a partially submitted tensor (0: off)
    stall_shutdown_time: float = 600.0  #: seconds before failing it with StallError (0: never)
    out_of_step_time: float = 5.0    #: seconds every rank may wait for names others lack (0: off)
    timeline: str = ""               #: Chrome-trace JSON path ("" = off)
    device: int = -1                 #: CUDA device of this rank (-1: local_rank % number of GPUs)
    cuda_ipc: bool = False           #: one node: reduce straight from peers' GPU buffers (CUDA IPC)
    cuda_aware_mpi: str = "auto"     #: "auto" detects; "1"/"0" force device buffers to MPI or not
    elastic: bool = False            #: ULFM job: waits notice dead peers (allreduce/elastic/)
    elastic_min_np: int = 1          #: below this many ranks an elastic job stops
    elastic_max_np: int = 0          #: an elastic job regrows up to this many ranks (0: no regrow)
    elastic_recovery_timeout: float = 120.0  #: seconds one recovery/regrow step may block in MPI (0: no bound)
    elastic_reset_limit: int = -1    #: an elastic job ends at its next shrink or regrow past this many (-1: never)
    elastic_hang_timeout: float = 0.0  #: seconds without a heartbeat before an elastic job evicts a rank (0: timeout)

    _ENV = {
        "algorithm": "ALLREDUCE_ALGORITHM",
        "check": "ALLREDUCE_CHECK",
        "segment_bytes": "ALLREDUCE_SEGMENT_BYTES",
        "timeout": "ALLREDUCE_TIMEOUT",
        "costmodel": "ALLREDUCE_COSTMODEL",
        "autotune": "ALLREDUCE_AUTOTUNE",
        "fake_node_size": "ALLREDUCE_FAKE_NODE_SIZE",
        "link": "ALLREDUCE_LINK",
        "shm_p2p": "ALLREDUCE_SHM_P2P",
        "engine": "ALLREDUCE_ENGINE",
        "cycle_time": "ALLREDUCE_CYCLE_TIME",
        "fusion_threshold": "ALLREDUCE_FUSION_THRESHOLD",
        "cache_capacity": "ALLREDUCE_CACHE_CAPACITY",
        "stall_check_time": "ALLREDUCE_STALL_CHECK_TIME",
        "stall_shutdown_time": "ALLREDUCE_STALL_SHUTDOWN_TIME",
        "out_of_step_time": "ALLREDUCE_OUT_OF_STEP_TIME",
        "timeline": "ALLREDUCE_TIMELINE",
        "device": "ALLREDUCE_DEVICE",
        "cuda_ipc": "ALLREDUCE_CUDA_IPC",
        "cuda_aware_mpi": "ALLREDUCE_CUDA_AWARE_MPI",
        "elastic": "ALLREDUCE_ELASTIC",
        "elastic_min_np": "ALLREDUCE_ELASTIC_MIN_NP",
        "elastic_max_np": "ALLREDUCE_ELASTIC_MAX_NP",
        "elastic_recovery_timeout": "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT",
        "elastic_reset_limit": "ALLREDUCE_ELASTIC_RESET_LIMIT",
        "elastic_hang_timeout": "ALLREDUCE_ELASTIC_HANG_TIMEOUT",
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
        if self.cuda_aware_mpi not in ("auto", "1", "0"):
            raise ValueError(f"cuda_aware_mpi must be auto, 1 or 0; got {self.cuda_aware_mpi!r}")
        if not self.cycle_time > 0:
            raise ValueError(f"cycle_time must be positive milliseconds, got {self.cycle_time}")
        for name in ("fusion_threshold", "cache_capacity", "stall_check_time", "stall_shutdown_time",
                     "out_of_step_time", "elastic_recovery_timeout", "elastic_hang_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.elastic_reset_limit < -1:
            raise ValueError(f"elastic_reset_limit must be >= 0, or -1 for no limit; got {self.elastic_reset_limit}")

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
        if "shm_p2p" not in values and not _btl_shares_memory(environ.get("OMPI_MCA_btl", "")):
            values["shm_p2p"] = False      # --mca btl tcp,self: the job stands in for separate nodes
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


def _btl_shares_memory(btl: str) -> bool:
    """Whether Open MPI's ``btl`` selection (``OMPI_MCA_btl``, set by ``--mca btl ...``) lets ranks
    use shared memory: unset, naming ``sm`` (or its old name ``vader``), or excluding others."""
    btl = btl.replace(" ", "")
    if not btl:
        return True
    shared = any(name in ("sm", "vader") for name in btl.lstrip("^").split(","))
    return not shared if btl.startswith("^") else shared


#: Open MPI settings allreduce applies unless the user chose otherwise: in ``allreduce-run``, and
#: in every rank before MPI starts (:mod:`allreduce.transport.mpi`, for a plain ``mpirun``). Open
#: MPI's UCX one-sided component prints a spurious error on machines without UCX hardware when
#: shm opens its MPI-3 shared window; the shared-memory component serves that window.
OPEN_MPI_DEFAULTS = {"OMPI_MCA_osc": "^ucx"}

#: Every environment variable :meth:`Config.from_env` reads (benchmarks print the ones that are set).
ENV_VARIABLES = tuple(Config._ENV.values())
