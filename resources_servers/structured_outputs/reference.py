"""structured_outputs: an answer document against the row's reference (``expected_document``).

Contract
--------
* :func:`parse_rules` reads a row's ``expected_rules`` (JSON Pointer -> rule) and checks that each rule
  has a place in the reference; anything else raises :class:`InvalidReference` (bad data: a 422).
* :func:`first_difference` compares a parsed, schema-validated answer with the reference and returns
  where and how the first field differs (``None`` when the answer matches):

  - objects: every key of the reference must be in the answer with a matching value; keys the
    reference leaves out are not compared (write in a reference only what the source determines);
  - strings: equal after NFKC, case folding and collapsing whitespace;
  - numbers: equal within a relative 1e-9 (``1969``, ``1969.0`` and ``1.969e3`` are one number), or
    the absolute ``tolerance`` of a rule; booleans and null: equal, never a number standing for them;
  - arrays: as many items as the reference, matched one to one in any order (a set of records, of
    tags); in order where the schema makes the array a tuple (``prefixItems``) or a rule says
    ``ordered``; ``contains``: the answer holds every reference item and may hold more.
* Rules (``expected_rules``), keyed by JSON Pointer into the reference (``""`` the root, ``/a/0/b``;
  ``*`` for every index of an array: ``/a/*/b``; a concrete pointer wins over its wildcard form): a string
  ``ordered`` / ``unordered`` / ``contains`` for an array, or a mapping with any of ``array`` (one of
  those), ``any_of`` (further accepted values besides the reference's), ``tolerance`` (absolute, for a
  number) and ``substrings`` (the answer's text must contain each, normalised as strings are; the
  reference's value there is an example, not compared).
* :func:`content_free` tells whether a document holds no value at all (every leaf an empty string,
  zero, false or null; empty arrays and objects): no answer to an extraction or conversion task.
* Comparison follows the reference's structure only, so its depth is the reference's; matching array
  items costs at most (reference items) x (answer items) comparisons. Pure: runs in the verify pool.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ARRAY_MODES = ("ordered", "unordered", "contains")
RULE_KEYS = ("array", "any_of", "tolerance", "substrings")
# Numbers within this relative difference are equal (float formatting, 1969 vs 1969.0).
REL_TOL = 1e-9
SHOW_CHARS = 80


class InvalidReference(ValueError):
    """``expected_document`` / ``expected_rules`` cannot be used (bad data, not a wrong answer)."""


@dataclass(frozen=True)
class Rule:
    array: str | None = None
    any_of: tuple[Any, ...] | None = None
    tolerance: float | None = None
    substrings: tuple[str, ...] | None = None


NO_RULE = Rule()


def _escape(part: str | int) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def pointer(path: list[str | int], wildcard: bool = False) -> str:
    """The JSON Pointer of ``path``; with ``wildcard``, every array index written ``*``."""
    return "".join("/" + ("*" if wildcard and isinstance(p, int) else _escape(p)) for p in path)


def _where(path: list[str | int]) -> str:
    return "/".join(str(p) for p in path) or "(root)"


def show(value: Any) -> str:
    """A value as JSON, cut to :data:`SHOW_CHARS` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # a value nested past json's depth: name its kind
        text = {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 1] + "…"


def normalise(text: str) -> str:
    """A string as compared: NFKC, case folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _places(expected: Any) -> tuple[dict[str, Any], set[str]]:
    """Every pointer into ``expected`` with the values found there, concrete ones and their wildcard
    forms (one pointer of each form per place; a wildcard one may stand for several values)."""
    values: dict[str, list[Any]] = {}
    concrete: set[str] = set()
    stack: list[tuple[list[str | int], Any]] = [([], expected)]
    while stack:
        path, value = stack.pop()
        concrete.add(pointer(path))
        values.setdefault(pointer(path), []).append(value)
        wild = pointer(path, wildcard=True)
        if wild != pointer(path):
            values.setdefault(wild, []).append(value)
        if isinstance(value, dict):
            stack.extend(([*path, k], v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(([*path, i], v) for i, v in enumerate(value))
    return values, concrete


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_rules(rules: Any, expected: Any) -> dict[str, Rule]:
    """``expected_rules`` checked against ``expected`` (the reference); raises :class:`InvalidReference`."""
    if rules is None:
        return {}
    if not isinstance(rules, dict):
        raise InvalidReference("expected_rules must be a mapping of JSON Pointer to rule")
    if expected is None:
        raise InvalidReference("expected_rules without expected_document")
    try:
        values, _ = _places(expected)
    except RecursionError:
        raise InvalidReference("expected_document is nested too deeply") from None
    out: dict[str, Rule] = {}
    for key, spec in rules.items():
        where = f"expected_rules[{key!r}]"
        if key not in values:
            raise InvalidReference(f"{where}: no place in expected_document has this pointer")
        if isinstance(spec, str):
            spec = {"array": spec}
        if not isinstance(spec, dict) or not spec or set(spec) - set(RULE_KEYS):
            raise InvalidReference(
                f"{where}: a rule is one of {', '.join(ARRAY_MODES)} or a mapping with keys among "
                f"{', '.join(RULE_KEYS)}, got {show(spec)}"
            )
        found = values[key]
        array, any_of = spec.get("array"), spec.get("any_of")
        tolerance, substrings = spec.get("tolerance"), spec.get("substrings")
        if array is not None and (array not in ARRAY_MODES or not all(isinstance(v, list) for v in found)):
            raise InvalidReference(f"{where}: array must be one of {', '.join(ARRAY_MODES)}, for an array")
        if any_of is not None and (not isinstance(any_of, list) or not any_of):
            raise InvalidReference(f"{where}: any_of must be a non-empty list of values")
        if tolerance is not None and (
            not _is_number(tolerance)
            or not math.isfinite(tolerance)
            or tolerance < 0
            or not all(_is_number(v) for v in found)
        ):
            raise InvalidReference(f"{where}: tolerance must be a number >= 0, for a number")
        if substrings is not None and (
            not isinstance(substrings, list)
            or not substrings
            or not all(isinstance(s, str) and s.strip() for s in substrings)
        ):
            raise InvalidReference(f"{where}: substrings must be a non-empty list of non-empty strings")
        out[key] = Rule(
            array=array,
            any_of=tuple(any_of) if any_of is not None else None,
            tolerance=float(tolerance) if tolerance is not None else None,
            substrings=tuple(substrings) if substrings is not None else None,
        )
    return out


def content_free(document: Any) -> bool:
    """Whether ``document`` holds no value: every leaf an empty (or blank) string, 0, false or null."""
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            if value.strip():
                return False
        elif value is not None and value is not False and value != 0:
            return False
    return True


def _subschema(schema: Any, part: str | int) -> Any:
    if not isinstance(schema, dict):
        return {}
    if isinstance(part, str):
        props = schema.get("properties")
        return props.get(part, {}) if isinstance(props, dict) else {}
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list) and part < len(prefix):
        return prefix[part]
    items = schema.get("items")
    return items if isinstance(items, dict) else {}


class _Comparer:
    def __init__(self, rules: dict[str, Rule]) -> None:
        self.rules = rules

    def rule(self, path: list[str | int]) -> Rule:
        if not self.rules:
            return NO_RULE
        found = self.rules.get(pointer(path))
        return found if found is not None else self.rules.get(pointer(path, wildcard=True), NO_RULE)

    def diff(
        self, expected: Any, answer: Any, path: list[str | int], schema: Any, alternatives: bool = True
    ) -> str | None:
        rule = self.rule(path)
        if alternatives and rule.any_of is not None:
            for candidate in (expected, *rule.any_of):
                if self.diff(candidate, answer, path, schema, alternatives=False) is None:
                    return None
            accepted = f"{show(expected)} or one of {show(list(rule.any_of))}"
            return f"at {_where(path)}: expected {accepted}, got {show(answer)}"
        if rule.substrings is not None:
            if not isinstance(answer, str):
                return f"at {_where(path)}: expected a text, got {show(answer)}"
            text = normalise(answer)
            missing = next((s for s in rule.substrings if normalise(s) not in text), None)
            if missing is None:
                return None
            return f"at {_where(path)}: expected a text mentioning {show(missing)}, got {show(answer)}"
        if isinstance(expected, dict):
            if not isinstance(answer, dict):
                return f"at {_where(path)}: expected an object, got {show(answer)}"
            for key, value in expected.items():
                if key not in answer:
                    return f"at {_where([*path, key])}: missing, expected {show(value)}"
                problem = self.diff(value, answer[key], [*path, key], _subschema(schema, key))
                if problem is not None:
                    return problem
            return None
        if isinstance(expected, list):
            if not isinstance(answer, list):
                return f"at {_where(path)}: expected an array, got {show(answer)}"
            mode = rule.array
            if mode is None:
                tuple_like = isinstance(schema, dict) and isinstance(schema.get("prefixItems"), list)
                mode = "ordered" if tuple_like else "unordered"
            return self.diff_array(expected, answer, path, schema, mode)
        if not self.scalar_equal(expected, answer, rule):
            return f"at {_where(path)}: expected {show(expected)}, got {show(answer)}"
        return None

    @staticmethod
    def scalar_equal(expected: Any, answer: Any, rule: Rule) -> bool:
        if isinstance(expected, bool) or expected is None:
            return answer is expected
        if _is_number(expected):
            if not _is_number(answer):
                return False
            return answer == expected or math.isclose(
                answer, expected, rel_tol=REL_TOL, abs_tol=rule.tolerance or 0.0
            )
        if isinstance(expected, str):
            return isinstance(answer, str) and normalise(answer) == normalise(expected)
        return expected == answer

    def diff_array(
        self, expected: list[Any], answer: list[Any], path: list[str | int], schema: Any, mode: str
    ) -> str | None:
        n, m = len(expected), len(answer)
        where = _where(path)
        if mode == "contains":
            if m < n:
                return f"at {where}: expected at least {n} items, got {m}"
        elif m != n:
            return f"at {where}: expected {n} items, got {m}"
        if mode == "ordered":
            for i in range(n):
                problem = self.diff(expected[i], answer[i], [*path, i], _subschema(schema, i))
                if problem is not None:
                    return problem
            return None
        unmatched = _Matching(self, expected, answer, path, schema).unmatched()
        if unmatched is None:
            return None
        out = f"at {where}: no item matches the expected {show(expected[unmatched])}"
        if unmatched < m:
            same = self.diff(
                expected[unmatched], answer[unmatched], [*path, unmatched], _subschema(schema, unmatched)
            )
            if same is not None:
                out += f" (item {unmatched} differs {same})"
        return out


def _signature(value: Any) -> Any:
    """A hashable form of a scalar as compared (strings normalised, numbers as floats), or None."""
    if value is None or isinstance(value, bool):
        return ("c", value)
    if _is_number(value):
        try:
            return ("n", float(value))
        except OverflowError:
            return ("n", str(value))
    return ("s", normalise(value)) if isinstance(value, str) else None


def _index_by_signature(items: list[Any], keys: tuple[str, ...] | None) -> dict[Any, list[int]]:
    """Answer indices by the signature of each item (``keys=None``: a scalar's own; else the signatures
    of those fields of an object)."""
    index: dict[Any, list[int]] = {}
    for j, item in enumerate(items):
        if keys is None:
            signature = None if isinstance(item, (dict, list)) else _signature(item)
        elif isinstance(item, dict) and all(k in item for k in keys):
            parts = tuple(_signature(item[k]) for k in keys)
            signature = None if None in parts else parts
        else:
            signature = None
        if signature is not None:
            index.setdefault(signature, []).append(j)
    return index


class _Matching:
    """One answer item for each reference item, all distinct (bipartite matching by augmenting paths).

    A reference item that fits at least n answer items (n reference items) can always be given one after
    the others, so each item's candidates stop at n. Candidates are found lazily, the item at the same
    index first: an answer in the reference's order costs n comparisons, any other at most n*m.
    """

    def __init__(
        self, comparer: _Comparer, expected: list[Any], answer: list[Any], path: list[str | int], schema: Any
    ) -> None:
        self.comparer, self.expected, self.answer = comparer, expected, answer
        self.path, self.schema = path, schema
        self.n, self.m = len(expected), len(answer)
        self.owner: list[int] = [-1] * self.m  # answer index -> the reference index it is given to
        self._found: dict[int, list[int]] = {}
        self._scans: dict[int, Iterator[int]] = {}
        self._index: dict[tuple[str, ...] | None, dict[Any, list[int]]] = {}

    def fits(self, i: int, j: int) -> bool:
        item_schema = _subschema(self.schema, i)
        return self.comparer.diff(self.expected[i], self.answer[j], [*self.path, i], item_schema) is None

    def _item_signature(self, i: int) -> tuple[tuple[str, ...] | None, Any]:
        """(keys, signature) of reference item ``i``: a scalar's own signature, or those of an object's
        scalar fields that no rule compares otherwise (None when it has none)."""
        item, path = self.expected[i], [*self.path, i]
        if not isinstance(item, dict):
            plain = self.comparer.rule(path) is NO_RULE
            return None, (_signature(item) if plain and not isinstance(item, list) else None)
        keys, parts = [], []
        for key, value in item.items():
            signature = _signature(value)
            if signature is not None and self.comparer.rule([*path, key]) is NO_RULE:
                keys.append(key)
                parts.append(signature)
        return (tuple(keys), tuple(parts)) if keys else (None, None)

    def _order(self, i: int) -> Iterator[int]:
        """Every answer index: the same index first, then those whose signature is the item's, then the
        rest. (Only an order: a signature that differs under a rule is found in the rest.)"""
        tried: set[int] = set()
        if i < self.m:
            tried.add(i)
            yield i
        keys, signature = self._item_signature(i)
        if signature is not None:
            if keys not in self._index:
                self._index[keys] = _index_by_signature(self.answer, keys)
            for j in self._index[keys].get(signature, ()):
                if j not in tried:
                    tried.add(j)
                    yield j
        yield from (j for j in range(self.m) if j not in tried)

    def candidates(self, i: int) -> Iterator[int]:
        """The answer items reference item ``i`` fits (at most n), found as they are asked for."""
        found = self._found.setdefault(i, [])
        scan = self._scans.setdefault(i, self._order(i))
        k = 0
        while True:
            if k < len(found):
                yield found[k]
                k += 1
                continue
            if len(found) >= self.n:
                return
            for j in scan:
                if self.fits(i, j):
                    found.append(j)
                    break
            else:
                return

    def unmatched(self) -> int | None:
        """The first reference item left without an answer item of its own, or None."""
        return next((i for i in range(self.n) if not self.augment(i)), None)

    def augment(self, root: int) -> bool:
        """Give ``root`` a free answer item, moving earlier reference items along an augmenting path."""
        stack: list[tuple[int, Iterator[int]]] = [(root, self.candidates(root))]
        entered_by: list[int] = []  # entered_by[k]: the answer item through which stack[k + 1] was reached
        seen: set[int] = set()
        while stack:
            i, options = stack[-1]
            for j in options:
                if j in seen:
                    continue
                seen.add(j)
                if self.owner[j] == -1:
                    self.owner[j] = i
                    for k in range(len(stack) - 2, -1, -1):
                        self.owner[entered_by[k]] = stack[k][0]
                    return True
                entered_by.append(j)
                stack.append((self.owner[j], self.candidates(self.owner[j])))
                break
            else:
                stack.pop()
                if entered_by:
                    entered_by.pop()
        return False


def first_difference(expected: Any, answer: Any, rules: dict[str, Rule], schema: Any) -> str | None:
    """Where ``answer`` first differs from ``expected`` (``at <path>: ...``), or None when it matches."""
    return _Comparer(rules).diff(expected, answer, [], schema)
