"""Configuration problems: the error a user must fix, where each key was set, and how problems read.

Contract
--------
* :class:`ConfigError` carries a message meant to be printed as is (every check raises it, one per
  check, listing every problem found: :func:`_format_problems`).
* :class:`Provenance` maps each dotted key to where it was last set (``configs/x.yaml:12`` or the
  command-line override), so a message names the file and line to fix (:func:`_loc`).
* :func:`did_you_mean` suggests the known names close to a mistyped one (difflib).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field


class ConfigError(Exception):
    """A configuration problem a user must fix; the message is meant to be printed as is."""


# --------------------------------------------------------------------------------------------------
# Provenance: where each dotted key was last set, so errors can say "configs/x.yaml:12".


@dataclass
class Provenance:
    """Where each dotted key was last set (``file:line`` or the command-line override)."""

    locations: dict[str, str] = field(default_factory=dict)

    def where(self, dotted: str) -> str | None:
        """The location of ``dotted`` or of its closest parent that has one (list indices ignored)."""
        key = dotted
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]
        return None

    def update(self, other: dict[str, str]) -> None:
        """Record ``other`` (later sources win)."""
        self.locations.update(other)


def _close(word: str, options: list[str] | tuple[str, ...], cutoff: float = 0.6) -> list[str]:
    """Up to three options close to ``word``, best first; one far better than the rest is named alone
    (``resource_servers``: ``resources_servers``, not also ``environment_servers``)."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, word, o).ratio(), o) for o in dict.fromkeys(options)),
        key=lambda t: -t[0],
    )
    scored = [(r, o) for r, o in scored if r >= cutoff][:3]
    return [o for r, o in scored if r >= scored[0][0] - 0.25] if scored else []


def _did_you_mean(word: str, options: list[str] | tuple[str, ...], prefix: str = "") -> str:
    matches = _close(word, options)
    if matches:
        return " Did you mean " + " or ".join(f"'{prefix}{m}'" for m in matches) + "?"
    return ""


def did_you_mean(word: str, options: list[str] | tuple[str, ...], prefix: str = "") -> str:
    """`` Did you mean 'x'?`` naming the options close to ``word``, or "" when none is."""
    return _did_you_mean(word, options, prefix)


def _loc(prov: Provenance, dotted: str) -> str:
    where = prov.where(dotted)
    return f" ({where})" if where else ""


def _format_problems(title: str, problems: list[str]) -> str:
    lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
    for p in problems:
        lines.append(f"  - {p}")
    return "\n".join(lines)
