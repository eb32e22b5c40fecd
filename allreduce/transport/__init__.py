"""Point-to-point transports: :class:`MPITransport` and the in-process :class:`ThreadTransport`."""
from .base import Request, Transport, wait_all
from .threads import ThreadTransport, ThreadWorld, run_threads

__all__ = ["Request", "Transport", "wait_all", "ThreadTransport", "ThreadWorld", "run_threads"]
