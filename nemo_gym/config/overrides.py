"""Command-line overrides in Hydra syntax: ``+key=value``, ``++key=value``, ``key=value``, ``~key``.

Contract
--------
* :func:`parse_cli_overrides` parses them (hydra's own parser) and raises :class:`ConfigError` on a
  syntax error, an empty key or a sweep (several values). The plain forms nearly every command line
  carries (``+config_paths=[a.yaml,b.yaml]``, ``+head_server.port=0``, ``+log_dir=logs``) are read
  without loading Hydra (:func:`plain_override`), with the result Hydra's parser gives for them
  (tests/test_config.py compares the two on every form it reads); everything else goes to Hydra.
* :func:`_apply_overrides` applies them in order to a config and returns where each key was set;
  deleting a key that is not there is an error with "did you mean". A secret key's override is
  quoted as ``+key=***`` in messages (:func:`nemo_gym.redaction.is_secret_key`).
"""

from __future__ import annotations

import re
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


# The plain forms (see plain_override): importing Hydra for its parser costs each ng_* command about
# 0.1 s of CPU before it can start anything, and these need none of its grammar.
_PLAIN_OVERRIDE = re.compile(r"\+{0,2}([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(.+)", re.DOTALL)
_PLAIN_WORD = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
_PLAIN_INT = re.compile(r"0|[1-9][0-9]*")
_HYDRA_WORDS = frozenset({"true", "false", "null", "inf", "nan"})  # Hydra reads these as bool/None/float


def _plain_value(text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` is one plain word, else (False, None). A word of digits alone (no
    leading zero) is an int; a word starting with a letter, ``_`` or ``/`` of letters, digits and
    ``_ . / -`` is a string, unless Hydra reads it as a bool, null, inf or nan."""
    if _PLAIN_INT.fullmatch(text):
        return True, int(text)
    if _PLAIN_WORD.fullmatch(text) and text.lower() not in _HYDRA_WORDS:
        return True, text
    return False, None


def plain_override(arg: str) -> CliOverride | None:
    """``arg`` parsed without Hydra when it is a plain override: ``key=value``, ``+key=value`` or
    ``++key=value`` with a dotted key of identifiers and a value that is one plain word
    (:func:`_plain_value`) or a bracketed list of them (``[a.yaml,b.yaml]``, ``[]``); else None."""
    match = _PLAIN_OVERRIDE.fullmatch(arg)
    if match is None:
        return None
    key, text = match.groups()
    if text == "[]":
        return CliOverride(key=key, value=[], delete=False, text=arg)
    if text.startswith("[") and text.endswith("]"):
        words = [_plain_value(word) for word in text[1:-1].split(",")]
        if not all(ok for ok, _ in words):
            return None
        return CliOverride(key=key, value=[value for _, value in words], delete=False, text=arg)
    ok, value = _plain_value(text)
    return CliOverride(key=key, value=value, delete=False, text=arg) if ok else None


def parse_cli_overrides(argv: list[str]) -> list[CliOverride]:
    """Parse Hydra-syntax overrides; raise ConfigError on syntax errors and sweeps."""
    plain = [plain_override(arg) for arg in argv]
    if all(o is not None for o in plain):
        return plain  # type: ignore[return-value]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    result = []
    for arg, parsed in zip(argv, plain, strict=True):
        if parsed is not None:
            result.append(parsed)
            continue
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
