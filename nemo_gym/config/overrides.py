"""Command-line overrides in Hydra syntax: ``+key=value``, ``++key=value``, ``key=value``, ``~key``.

Contract
--------
* :func:`parse_cli_overrides` parses them (hydra's own parser) and raises :class:`ConfigError` on a
  syntax error, an empty key or a sweep (several values).
* :func:`_apply_overrides` applies them in order to a config and returns where each key was set;
  deleting a key that is not there is an error with "did you mean". A secret key's override is
  quoted as ``+key=***`` in messages (:func:`nemo_gym.redaction.is_secret_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_gym.config.problems import ConfigError, _did_you_mean
from nemo_gym.redaction import is_secret_key


@dataclass
class CliOverride:
    """One parsed ``+key=value`` / ``++key=value`` / ``key=value`` / ``~key`` argument."""

    key: str
    value: Any
    delete: bool
    text: str


def parse_cli_overrides(argv: list[str]) -> list[CliOverride]:
    """Parse Hydra-syntax overrides; raise ConfigError on syntax errors and sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    result = []
    for arg in argv:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as e:
            raise ConfigError(
                f"Cannot parse command-line override {arg!r}: {e}\n"
                "Overrides use Hydra syntax, e.g. +config_paths=[a.yaml,b.yaml] ++policy_model_name=gpt-4o"
            ) from None
        if not override.key_or_group:
            raise ConfigError(
                f"Cannot parse command-line override {arg!r}: the key before '=' is empty.\n"
                "Overrides use Hydra syntax, e.g. +config_paths=[a.yaml,b.yaml] ++policy_model_name=gpt-4o"
            )
        if override.is_sweep_override():
            raise ConfigError(
                f"Command-line override {arg!r} is a sweep (several values); sweeps are not supported.\n"
                f"Give one value: a list is written in brackets (+{override.key_or_group}=[a,b]), "
                f"a string containing commas is quoted (+{override.key_or_group}='a,b')."
            )
        result.append(
            CliOverride(
                key=override.key_or_group,
                value=None if override.is_delete() else override.value(),
                delete=override.is_delete(),
                text=arg,
            )
        )
    return result


def _apply_overrides(cfg: DictConfig, overrides: list[CliOverride]) -> dict[str, str]:
    """Apply ``overrides`` in order to ``cfg`` (in place); return the locations they set."""
    locations = {}
    for o in overrides:
        if o.delete:
            parent_key, _, leaf = o.key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                siblings = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
                raise ConfigError(
                    f"Command-line override `{o.text}` deletes '{o.key}', which is not in the config."
                    f"{_did_you_mean(leaf, siblings, prefix=parent_key + '.' if parent_key else '')}"
                    " Remove the override or fix the key."
                )
            del parent[leaf]
            continue
        try:
            OmegaConf.update(cfg, o.key, o.value, merge=True, force_add=True)
        except Exception as e:  # e.g. a dotted key below a list or a scalar
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"Command-line override `{o.text}` cannot be applied: {first}") from None
        # The override is quoted in error messages: not with a credential in it.
        text = f"{o.text.partition('=')[0]}=***" if is_secret_key(o.key.rpartition(".")[2]) else o.text
        locations[o.key] = f"command-line override `{text}`"
        if isinstance(o.value, dict):
            for sub in _flatten_keys(o.value, o.key + "."):
                locations[sub] = f"command-line override `{text}`"
    return locations


def _flatten_keys(d: dict, prefix: str) -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out.extend(_flatten_keys(v, f"{prefix}{k}."))
    return out
