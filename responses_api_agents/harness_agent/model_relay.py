"""Runs INSIDE a harness's sandbox: the model server at 127.0.0.1:<port>, then the harness itself.

``python3 -I -S model_relay.py <unix socket> <port> <harness argv...>`` (the sandbox's own Python,
standard library only; nothing of nemo_gym is imported: harness_agent copies the file into the rollout's
run dir, bound read-only at /run/ng-harness).
It listens on 127.0.0.1:<port> in the sandbox's own network namespace (where nothing else of the host's
network exists), forks a relay process that copies each connection's bytes to and from a new connection
to ``<unix socket>`` (bound into the sandbox; harness_agent listens on its host end and connects it to the
rollout's model server), and execs the harness in its own place, so the harness is the program the
sandbox waits for (its exit status, its signals). The relay dies with the harness: the sandbox kills every
process left when its program returns. The listening socket exists before the harness starts, so its first
connection never finds the port closed.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

_CHUNK = 1 << 16
_MAX_CONNECTIONS = 64


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(_CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listener: socket.socket, path: str) -> None:
    slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
    while True:
        conn, _ = listener.accept()
        if not slots.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=_connection, args=(conn, path, slots), daemon=True).start()


def _connection(conn: socket.socket, path: str, slots: threading.BoundedSemaphore) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
        back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
        back.start()
        _pipe(conn, upstream)
        back.join()
    except OSError:
        pass
    finally:
        conn.close()
        upstream.close()
        slots.release()


def main() -> None:
    path, port, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(_MAX_CONNECTIONS)
    if os.fork() == 0:  # the relay: no stdio of the harness's (the sandbox reads those to their end)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            _serve(listener, path)
        finally:
            os._exit(0)
    listener.close()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"ng-harness: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main()
