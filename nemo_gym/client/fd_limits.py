"""Open-file limits: raise the soft limit at start, and size socket pools from the budget left.

Contract
--------
* :func:`raise_open_file_limit` is called first thing by every process of ours (each server,
  ``ng_run``, ``RunHelper``, the collector, ``ng_bench``, ``ng_viewer``, and any process that opens
  a :class:`~nemo_gym.client.server_client.ServerClient` pool). It sets the soft ``RLIMIT_NOFILE`` to the
  hard limit, once per process, and logs the value (a warning when it is low). It never lowers a
  limit and never fails: where the limit cannot be changed it reports what is in force.
* :func:`socket_budget` is how many more sockets this process may open: the soft limit, minus the
  descriptors open now, minus a reserve for files, pipes, listening sockets and the event loop.
* A server process splits its budget once at start (:func:`split_server_budget`): half for the
  connections it accepts, half for the connections it opens. :func:`client_socket_budget` is the
  outbound share there, and the whole budget left in any other process. Connection pools are sized
  ``min(configured size, client_socket_budget())`` and queue requests beyond it, so reaching the
  limit means waiting for a free connection, never "Too many open files".
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("nemo_gym")

# Below this many descriptors, the limit (not the configured pool sizes) decides how many
# connections a process holds; that is worth a warning naming the fix.
LOW_LIMIT_WARNING = 4096

_soft_limit: int | None = None  # set once by raise_open_file_limit()
_client_share: int | None = None  # set by split_server_budget() in a server process


def _resource():  # type: ignore[no-untyped-def]
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise or measure
        return None
    return resource


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (once per process); return the soft limit."""
    global _soft_limit
    if _soft_limit is not None:
        return _soft_limit
    resource = _resource()
    if resource is None:
        _soft_limit = 1 << 16
        return _soft_limit
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        # The kernel caps descriptors below "unlimited" (Linux: fs.nr_open; macOS: OPEN_MAX).
        targets = [_nr_open(), 1 << 20, 10240]
    else:
        targets = [hard]
    for target in targets:
        if target <= before:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    _soft_limit = soft = soft if soft != resource.RLIM_INFINITY else 1 << 20
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    how = f"raised from {before}" if soft > before else "unchanged"
    if soft < LOW_LIMIT_WARNING:
        logger.warning(
            "open-file limit %d (hard limit %s, %s): connections are capped to fit and requests queue "
            "for a free one; raise the hard limit (ulimit -Hn, /etc/security/limits.conf) for more concurrency",
            soft,
            shown_hard,
            how,
        )
    else:
        logger.info("open-file limit %d (hard limit %s, %s)", soft, shown_hard, how)
    return soft


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def open_fd_count() -> int:
    """How many descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself opened
    except OSError:
        import psutil

        try:
            return psutil.Process().num_fds()
        except (AttributeError, psutil.Error):
            return 64


def reserve_for(soft: int) -> int:
    """Descriptors kept free for everything but sockets: 1/8 of the limit, at least 32, at most 1,024."""
    return min(max(32, soft // 8), 1024)


def socket_budget() -> int:
    """How many more sockets this process may open now (at least 1)."""
    soft = raise_open_file_limit()
    return max(1, soft - open_fd_count() - reserve_for(soft))


def split_server_budget() -> int:
    """In a server process at start: fix the outbound share; return how many connections to accept at once."""
    global _client_share
    budget = socket_budget()
    inbound = max(1, budget // 2)
    _client_share = max(1, budget - inbound)
    logger.info(
        "socket budget: %d accepted connections at once, %d outbound connections", inbound, _client_share
    )
    return inbound


def client_socket_budget() -> int:
    """How many sockets a new outbound connection pool of this process may hold."""
    if _client_share is not None:
        return _client_share
    return socket_budget()
