"""Resolve an environment's ``sandbox_provider`` setting into one provider block (upstream's module path).

Contract
--------
* ``sandbox_provider`` is either the name of a top-level block of the merged config (so a run swaps
  providers by swapping a config file) or an inline single-key mapping ``{provider_name: {...}}``.
* :func:`resolve_provider_config` returns ``{provider_name: provider_settings}`` as plain dicts
  (OmegaConf nodes are converted, interpolations resolved). The block must hold exactly one provider
  key besides the reserved ``default_metadata``; otherwise a :class:`ValueError` names the keys found.
  A name that is not a top-level block is a :class:`ValueError` listing the blocks that could be meant
  (top-level mappings with exactly one provider key); a value that is neither a name nor a mapping is a
  :class:`TypeError`.
* :func:`resolve_provider_metadata` returns the block's ``default_metadata`` mapping (``{}`` when
  absent): defaults for a sandbox's metadata that the environment's own metadata overrides.
* Which providers exist is :mod:`nemo_gym.sandbox.api`'s business (``provider={"backend": ...}``);
  nothing here checks the provider name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_METADATA_KEY = "default_metadata"
RESERVED_BLOCK_KEYS = frozenset({DEFAULT_METADATA_KEY})

__all__ = [
    "DEFAULT_METADATA_KEY",
    "RESERVED_BLOCK_KEYS",
    "resolve_provider_config",
    "resolve_provider_metadata",
]


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain Python (resolved); mappings as dicts; anything else unchanged."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _provider_names(block: Mapping[str, Any]) -> list[str]:
    return [str(key) for key in block if key not in RESERVED_BLOCK_KEYS]


def _candidates(named_configs: Mapping[str, Any] | None) -> list[str]:
    found = []
    for key, value in (named_configs or {}).items():
        plain = _plain(value)
        if isinstance(plain, Mapping) and len(_provider_names(plain)) == 1:
            found.append(str(key))
    return sorted(found)


def _block(
    sandbox_provider: str | Mapping[str, Any], named_configs: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """The referenced (or inline) block as a plain dict, and words naming where it came from."""
    if isinstance(sandbox_provider, str):
        if not sandbox_provider:
            raise ValueError("sandbox_provider: an empty name refers to no sandbox config block")
        block = None if named_configs is None else named_configs.get(sandbox_provider)
        if block is None:
            known = ", ".join(repr(n) for n in _candidates(named_configs)) or "none"
            raise ValueError(
                f"sandbox_provider: {sandbox_provider!r} is not a top-level block of the merged config; "
                f"add a '{sandbox_provider}:' block (one provider key) through config_paths. "
                f"Sandbox blocks found: {known}"
            )
        where = f"sandbox_provider {sandbox_provider!r}"
    elif isinstance(sandbox_provider, Mapping):
        block, where = sandbox_provider, "the inline sandbox_provider mapping"
    else:
        raise TypeError(
            f"sandbox_provider must be a block name (str) or a mapping {{provider_name: settings}}, "
            f"got {type(sandbox_provider).__name__}"
        )
    plain = _plain(block)
    if not isinstance(plain, Mapping):
        raise ValueError(f"{where} must be a mapping {{provider_name: settings}}, got {plain!r}")
    return dict(plain), where


def resolve_provider_config(
    sandbox_provider: str | Mapping[str, Any], named_configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{provider_name: settings}`` for ``sandbox_provider`` (a block name in ``named_configs``, or inline)."""
    block, where = _block(sandbox_provider, named_configs)
    names = _provider_names(block)
    if len(names) != 1:
        raise ValueError(
            f"{where} must hold exactly one provider key (besides {DEFAULT_METADATA_KEY}), got {names}"
        )
    return {names[0]: block[names[0]]}


def resolve_provider_metadata(
    sandbox_provider: str | Mapping[str, Any], named_configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The block's ``default_metadata`` (``{}`` when it has none)."""
    block, where = _block(sandbox_provider, named_configs)
    metadata = block.get(DEFAULT_METADATA_KEY) or {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: {DEFAULT_METADATA_KEY} must be a mapping, got {metadata!r}")
    return dict(metadata)
