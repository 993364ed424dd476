"""Port reservation: the launcher binds every listening socket itself and hands it to the child.

Binding port 0 lets the kernel pick a port no other socket holds, and since the socket stays bound
(and listening) from reservation until the child serves on it, no other process, not even a second
``ng_run`` started at the same moment, can take it in between. A port set explicitly in the config
that is already taken is reported before any server starts.
"""

from __future__ import annotations

import socket

from nemo_gym.global_config import ConfigError


def reserve_listening_socket(host: str, port: int | None, what: str) -> socket.socket:
    """A bound, listening, inheritable TCP socket on ``host:port`` (``port`` 0/None: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or 0))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"Cannot listen on {host}:{port} for {what}: {e.strerror}. "
            + ("Another process is using that port; choose another port or leave it unset to get a free one."
               if e.errno in (98, 48) else "Check the host address.")
        ) from None
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock
