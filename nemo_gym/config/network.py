"""Ports and connections as the config sets them: the port range, client connection limits, a free port.

Contract
--------
* :func:`configured_port_range` reads ``port_range_low``/``port_range_high`` (upstream's defaults
  fill the one not set) and raises ``ValueError`` on a bad range.
* :func:`connection_limits_from` reads ``global_aiohttp_connector_limit`` (default 1024) and
  ``..._per_host`` (default: no cap beyond the total) from a given config, raising ``ValueError``
  naming the key on a value that is not a positive integer. The process's own limits (its held
  config) are ``nemo_gym.config.process.client_connection_limits``.
* :func:`find_open_port` is upstream's helper; our launcher binds its sockets itself
  (:mod:`nemo_gym.config.ports`) and never relies on it.
"""

from __future__ import annotations

from omegaconf import DictConfig

from nemo_gym.config.keys import (
    DEFAULT_CONNECTION_LIMIT,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
    PORT_RANGE_HIGH_KEY_NAME,
    PORT_RANGE_LOW_KEY_NAME,
)


def find_open_port(disallowed_ports: list[int] | None = None, max_retries: int = 50) -> int:
    """A TCP port free on this machine right now and not in ``disallowed_ports``.

    The port may be taken by someone else before it is used; our launcher never relies on this (it
    binds its sockets itself, see :mod:`nemo_gym.config.ports`). Raises ``RuntimeError`` after ``max_retries``.
    """
    import socket

    disallowed = set(disallowed_ports or ())
    for _ in range(max(1, max_retries)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        if port not in disallowed:
            return port
    raise RuntimeError(f"No free port outside {sorted(disallowed)} after {max_retries} tries.")


def connection_limits_from(cfg: DictConfig | dict | None) -> tuple[int, int | None]:
    """``(total, per_host)`` HTTP client connection limits set in ``cfg`` (None: the defaults).

    From ``global_aiohttp_connector_limit`` (default 1024) and
    ``global_aiohttp_connector_limit_per_host`` (default: no limit beyond the total). A value that is
    not a positive integer raises ``ValueError`` naming the key.
    """
    out: list[int | None] = []
    for key, default in (
        (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME, DEFAULT_CONNECTION_LIMIT),
        (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME, None),
    ):
        raw = cfg.get(key) if cfg is not None else None
        if raw is None:
            out.append(default)
            continue
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = 0
        if value < 1 or isinstance(raw, bool):
            raise ValueError(f"{key} must be a positive integer (a connection count), got {raw!r}")
        out.append(value)
    return out[0] or DEFAULT_CONNECTION_LIMIT, out[1]


def configured_port_range(cfg: DictConfig | dict) -> tuple[int, int] | None:
    """``(port_range_low, port_range_high)`` when either is set (upstream's defaults fill the other:
    10001 and 20000), else None (the system picks any free port). Raises ``ValueError`` on a bad range."""
    low, high = cfg.get(PORT_RANGE_LOW_KEY_NAME), cfg.get(PORT_RANGE_HIGH_KEY_NAME)
    if low is None and high is None:
        return None
    try:
        lo, hi = int(10001 if low is None else low), int(20000 if high is None else high)
    except (TypeError, ValueError):
        raise ValueError(
            f"port_range_low / port_range_high must be port numbers, got {low!r} / {high!r}"
        ) from None
    if not 1 <= lo < hi <= 65536:
        raise ValueError(
            f"port_range_low ({lo}) must be below port_range_high ({hi}), both within 1..65536 "
            "(the range is [low, high))"
        )
    return lo, hi
