"""A cluster on one machine: network namespaces as hosts, shaped links, real multi-host MPI launches.

* :mod:`.net`: the hosts, the bridge, the tbf-shaped links, the state file; ``down``.
* :mod:`.launch`: the rsh agent and the mpirun flags that put ranks on hosts, each host on its own cores.
* :mod:`.probe`: one TCP stream and a round trip between two hosts: the link's measured constants.
* :mod:`.cli`: the ``allreduce-cluster up | down | status`` command.

``allreduce-run --cluster -np P python train.py`` launches over the cluster that is up.
"""
from .cli import main, up
from .net import DEFAULT_PREFIX, Cluster, Host, down, load

__all__ = ["main", "up", "down", "load", "Cluster", "Host", "DEFAULT_PREFIX"]
