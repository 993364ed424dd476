"""Named outside sandbox providers (upstream's ``register_provider`` / ``list_providers`` / ``create_provider``).

Contract
--------
* ``register_provider(name, cls)`` makes ``cls`` (called with the provider block's settings as keyword
  arguments) available as ``provider={name: {...}}``. Registering a taken name with another class is a
  :class:`ValueError`; registering the same class again is a no-op. The built-in backends' names
  (``bubblewrap``, ``unsafe_local_subprocess``) and the keys of the ``sandbox:`` config block are
  reserved: they keep meaning the built-in backends.
* ``list_providers()`` lists the registered names (sorted); ``get_provider_class(name)`` returns one
  (``ValueError`` naming the registered ones when unknown).
* ``create_provider({name: settings})`` makes a provider instance. Settings must be a mapping (or
  null); the config must hold exactly one key. Errors name the key.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from nemo_gym.sandbox.spec import SandboxProviderConfig

_LOCK = threading.Lock()
_PROVIDERS: dict[str, type] = {}
BUILTIN_BACKENDS = ("bubblewrap", "unsafe_local_subprocess")

__all__ = [
    "create_provider",
    "get_provider_class",
    "is_registered_provider_config",
    "list_providers",
    "register_provider",
]


def _reserved() -> set[str]:
    return set(BUILTIN_BACKENDS) | set(SandboxProviderConfig.model_fields)


def register_provider(name: str, provider_cls: type) -> None:
    """Make ``provider_cls`` available as ``provider={name: {...}}``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_provider: name must be a non-empty string, got {name!r}")
    if name in _reserved():
        raise ValueError(f"register_provider: {name!r} is reserved for the built-in sandbox backends")
    with _LOCK:
        existing = _PROVIDERS.get(name)
        if existing is not None and existing is not provider_cls:
            raise ValueError(f"register_provider: {name!r} is already registered to {existing.__qualname__}")
        _PROVIDERS[name] = provider_cls


def list_providers() -> list[str]:
    with _LOCK:
        return sorted(_PROVIDERS)


def get_provider_class(name: str) -> type:
    with _LOCK:
        cls = _PROVIDERS.get(name)
    if cls is None:
        raise ValueError(
            f"sandbox provider {name!r} is not registered here; registered: {list_providers() or 'none'}; "
            f"built-in backends: provider={{'backend': one of {list(BUILTIN_BACKENDS)}}}"
        )
    return cls


def is_registered_provider_config(provider: Any) -> bool:
    """True for ``{name: settings}`` whose single key is a registered provider."""
    if not isinstance(provider, Mapping) or len(provider) != 1:
        return False
    (name,) = provider
    with _LOCK:
        return name in _PROVIDERS


def create_provider(config: Mapping[str, Any]) -> Any:
    """An instance of the registered provider ``config`` names, built from its settings."""
    if not isinstance(config, Mapping) or len(config) != 1:
        keys = list(config) if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(
            f"sandbox provider config must be {{provider_name: settings}} with one key, got {keys}"
        )
    ((name, settings),) = config.items()
    if settings is None:
        settings = {}
    if not isinstance(settings, Mapping):
        raise ValueError(f"sandbox provider {name!r}: its settings must be a mapping, got {settings!r}")
    return get_provider_class(name)(**dict(settings))
