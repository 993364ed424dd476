"""Missing values: keys set to ``???``, interpolations of keys that are not set, unresolvable values.

Contract
--------
* :func:`find_missing_values` returns one line per missing key, with the ``++key=<value>`` override
  that sets it, where it is declared and which values need it (values that need the same key are
  grouped under it), then one line per value that cannot be resolved. Nothing is resolved twice and
  nothing is raised: the whole-config check (:mod:`nemo_gym.config.validation`) reports the lines.
* :func:`_iter_leaves`, :data:`_INTERP_RE` and :func:`_absolute_ref` (walk a config's leaves, find
  ``${...}`` interpolations, make a relative one absolute) are shared with the option check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
)

from nemo_gym.config.problems import Provenance, _loc


def _iter_leaves(node: Any, prefix: str):
    if isinstance(node, DictConfig):
        for k in node.keys():
            yield from _iter_leaves(node._get_node(k), f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_leaves(node._get_node(i), f"{prefix}[{i}]")
    else:
        yield prefix, node


_INTERP_RE = re.compile(r"\$\{([^}]+)\}")
_MISSING_VALUE_RE = re.compile(r"Missing mandatory value: (\S+)")
_MAX_USERS_SHOWN = 3
_MAX_MISSING_DETAILED = 12
_UNSET = object()


def _absolute_ref(ref: str, path: str) -> str:
    """The absolute dotted key of interpolation ``ref`` used at ``path`` (handles ``${.x}``/``${..x}``)."""
    if not ref.startswith("."):
        return ref
    dots = len(ref) - len(ref.lstrip("."))
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    base = parts[: max(len(parts) - dots, 0)]
    return ".".join([*base, ref[dots:]])


@dataclass
class _Missing:
    declared_at: str | None = None  # where the key is set to ``???``
    users: list[str] = field(default_factory=list)  # "path (file:line)" of values that interpolate it


def find_missing_values(cfg: DictConfig, prov: Provenance) -> list[str]:
    """One line per value that is ``???``, interpolates a key that is not set, or cannot be resolved.

    Values that need the same missing key are grouped under it, so ``${policy_base_url}`` used by
    three servers is reported once, with the override that sets it.
    """
    return _find_missing(cfg, prov)[1]


def _find_missing(cfg: DictConfig, prov: Provenance) -> tuple[int, list[str]]:
    """(number of missing keys and unresolvable values, the lines describing them)."""
    missing: dict[str, _Missing] = {}
    unresolvable: list[str] = []
    for path, node in _iter_leaves(cfg, ""):
        try:
            OmegaConf.select(cfg, path, throw_on_missing=True, throw_on_resolution_failure=True)
        except MissingMandatoryValue:
            missing.setdefault(path, _Missing()).declared_at = (
                f"??? at {prov.where(path)}" if prov.where(path) else "???"
            )
        except InterpolationToMissingValueError as e:
            m = _MISSING_VALUE_RE.search(str(e))
            target = m.group(1) if m else path
            missing.setdefault(target, _Missing()).users.append(f"{path}{_loc(prov, path)}")
        except InterpolationKeyError:
            raw = node._value() if hasattr(node, "_value") else None
            refs = [
                _absolute_ref(r.strip(), path)
                for r in _INTERP_RE.findall(raw if isinstance(raw, str) else "")
            ]
            refs = [r for r in refs if ":" not in r] or [path]
            target = next((r for r in refs if OmegaConf.select(cfg, r, default=_UNSET) is _UNSET), refs[0])
            missing.setdefault(target, _Missing()).users.append(f"{path}{_loc(prov, path)}")
        except InterpolationResolutionError as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            reason = reason.replace("KeyError raised while resolving interpolation: ", "").strip('"')
            raw = node._value() if hasattr(node, "_value") else ""
            unresolvable.append(
                f"{path}{_loc(prov, path)}: `{raw}` cannot be resolved: {reason}. "
                f"Fix it, or set it directly with ++{path}=<value>."
            )
    out = []
    width = max((len(k) for k in missing), default=0) + len("++=<value>")
    for key, info in missing.items():
        notes = []
        notes.append(info.declared_at or "not defined anywhere")
        if info.users:
            shown = info.users[:_MAX_USERS_SHOWN]
            more = len(info.users) - len(shown)
            notes.append("needed by " + ", ".join(shown) + (f" and {more} more" if more else ""))
        out.append(f"{f'++{key}=<value>'.ljust(width)}  ({'; '.join(notes)})")
    if len(out) > _MAX_MISSING_DETAILED:  # still list every key, compactly, to stay on one screen
        rest = ", ".join(f"++{key}" for key in list(missing)[_MAX_MISSING_DETAILED:])
        out = out[:_MAX_MISSING_DETAILED] + [f"also not set: {rest}"]
    return len(missing) + len(unresolvable), out + unresolvable
