"""How an on/off key of the config reads, the same for every switch (``metrics_enabled``,
``observability_enabled``, ``ray_start_local``, ...).

A YAML or Hydra value arrives as a bool, but a value set through ``env.yaml`` interpolation or a trainer's
dict may be a string: ``true``/``1``/``yes``/``on`` and ``false``/``0``/``no``/``off``/``none``/empty read as
such (any case); anything else, and an unset key, is the switch's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ON_WORDS = frozenset({"true", "1", "yes", "on"})
OFF_WORDS = frozenset({"", "false", "0", "no", "off", "none"})


def flag(value: Any, default: bool) -> bool:
    """``value`` read as an on/off switch (see the module docstring)."""
    if value is None:
        return default
    if isinstance(value, str):
        word = value.strip().lower()
        return True if word in ON_WORDS else False if word in OFF_WORDS else default
    return bool(value)


def config_flag(config: Mapping[str, Any] | Any | None, key: str, default: bool) -> bool:
    """The switch ``key`` of a config (a mapping or DictConfig; anything else holds no keys)."""
    get = getattr(config, "get", None)
    return flag(get(key) if callable(get) else None, default)
