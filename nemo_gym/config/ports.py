"""Port reservation: the launcher binds every listening socket itself and hands it to the child.

Binding port 0 lets the kernel pick a port no other socket holds. The socket stays bound (and
listening) from reservation until the child serves on it, so no other process, not even a second
``ng_run`` started at the same moment, can take it in between. Automatically chosen ports are bound
*without* ``SO_REUSEADDR``: on Linux a second socket can share a port only when both set it, so
nobody can bind a port we picked even in the instant between our ``bind`` and ``listen``.
An explicitly configured port gets ``SO_REUSEADDR`` (so a port left in TIME_WAIT by a previous
run is usable at once); if something else already listens there, that is reported before any
server starts, with what to do (``busy_hint``: the head server's default port is not a free pick,
so "leave it unset" would not help there).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

from nemo_gym.config.problems import ConfigError

LISTEN_BACKLOG = 4096


def reserve_listening_socket(
    host: str, port: int | None, what: str, busy_hint: Callable[[], str] | None = None
) -> socket.socket:
    """A bound, listening, inheritable TCP socket on ``host:port`` (``port`` 0/None: any free port).

    ``what`` names the owner for the error message (e.g. ``server 'policy_model'``); ``busy_hint``
    says what to do when the port is taken (default: choose another or leave it unset, which is
    right for owners whose unset port means a free one). Raises :class:`ConfigError` when the
    address cannot be bound or listened on.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port or 0))
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            hint = (
                busy_hint()
                if busy_hint is not None
                else "Another process is using that port; choose another port or leave it unset to get a free one."
            )
        else:
            hint = "Check the host address."
        raise ConfigError(
            f"Cannot listen on {host}:{port or 0} for {what}: {e.strerror or e}. {hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


def reserve_listening_socket_in_range(
    host: str, low: int, high: int, what: str, avoid: set[int] | frozenset[int] = frozenset()
) -> socket.socket:
    """A bound, listening, inheritable socket on a free port in ``[low, high)`` other than ``avoid``.

    For ``port_range_low`` / ``port_range_high`` (e.g. a cluster that only opens some ports). Ports
    are tried in random order, bound without ``SO_REUSEADDR`` like every automatically chosen port.
    Raises :class:`ConfigError` naming the range when none is free.
    """
    import random

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [p for p in range(low, high) if p not in avoid]
    random.shuffle(candidates)
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
        except OSError as e:
            sock.close()
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise ConfigError(
                f"Cannot listen on {host}:{port} for {what}: {e.strerror or e}. Check the host address."
            ) from None
        sock.set_inheritable(True)
        return sock
    raise ConfigError(
        f"No free port in [port_range_low, port_range_high) = [{low}, {high}) on {host} for {what}. "
        "Widen the range, or unset both keys to let the system pick any free port."
    )
