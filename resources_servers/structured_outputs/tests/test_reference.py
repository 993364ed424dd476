"""The reference rules of structured_outputs (``expected_document`` / ``expected_rules``), in process: right
answers written otherwise still match, wrong values are named, bad references are bad data."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from resources_servers.structured_outputs.app import check_document
from resources_servers.structured_outputs.reference import (
    InvalidReference,
    content_free,
    first_difference,
    parse_rules,
    pointer,
)


def _diff(expected: Any, answer: Any, rules: dict[str, Any] | None = None, schema: Any = None) -> str | None:
    return first_difference(expected, answer, parse_rules(rules, expected), schema or {})


BOOK = {
    "title": "The Left Hand of Darkness",
    "author": "Ursula K. Le Guin",
    "year": 1969,
    "tags": ["sf", "novel"],
}


@pytest.mark.parametrize(
    "answer",
    [
        # Case, spacing (inner runs too), Unicode compatibility forms (full-width letters, a no-break space).
        {**BOOK, "title": "  the LEFT hand of\tdarkness ", "author": "URSULA K.\u00a0LE GUIN"},
        {**BOOK, "title": "\uff34\uff48\uff45 Left Hand of Darkness"},
        # Key order.
        dict(reversed(list(BOOK.items()))),
        # Number formats: 1969, 1969.0, 1.969e3 are one number.
        {**BOOK, "year": 1969.0},
        {**BOOK, "year": json.loads("1.969e3")},
        # Item order of an array that is not a tuple.
        {**BOOK, "tags": ["NOVEL", "sf"]},
    ],
)
def test_right_answers_written_otherwise_match(answer: dict[str, Any]) -> None:
    assert _diff(BOOK, answer) is None


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            {**BOOK, "title": "The Right Hand of Darkness"},
            'at title: expected "The Left Hand of Darkness", got',
        ),
        ({**BOOK, "year": 1970}, "at year: expected 1969, got 1970"),
        ({**BOOK, "year": "1969"}, 'at year: expected 1969, got "1969"'),
        ({**BOOK, "tags": ["sf"]}, "at tags: expected 2 items, got 1"),
        (
            {**BOOK, "tags": ["sf", "sf"]},
            'at tags: no item matches the expected "novel" (item 1 differs at tags/1',
        ),
        ({**BOOK, "tags": "sf, novel"}, 'at tags: expected an array, got "sf, novel"'),
        (
            {k: v for k, v in BOOK.items() if k != "author"},
            'at author: missing, expected "Ursula K. Le Guin"',
        ),
        ("The Left Hand of Darkness", 'at (root): expected an object, got "The Left Hand of Darkness"'),
    ],
)
def test_a_wrong_value_is_named_by_its_path(answer: Any, reason: str) -> None:
    assert (_diff(BOOK, answer) or "").startswith(reason)


@pytest.mark.parametrize(
    ("expected", "answer", "same"),
    [
        (0.3, 0.1 + 0.2, True),  # float arithmetic's last bit
        (300, 300.000001, False),  # a relative 1e-9, no more
        (True, 1, False),  # a boolean is never a number, nor a number a boolean
        (1, True, False),
        (0, False, False),
        (None, "", False),
        ("", None, False),
        (None, None, True),
        (2**70, float(2**70), True),
    ],
)
def test_scalars(expected: Any, answer: Any, same: bool) -> None:
    assert (_diff(expected, answer) is None) is same


def test_rules_tolerance_any_of_substrings_and_array_modes() -> None:
    expected = {"grams": 300, "name": "tomato", "note": "Keep cold", "steps": ["wash", "cut"], "tags": ["a"]}
    rules = {
        "/grams": {"tolerance": 0.5},
        "/name": {"any_of": ["tomatoes", "cherry tomatoes"]},
        "/note": {"substrings": ["cold"]},
        "/steps": "ordered",
        "/tags": "contains",
    }
    right = {"grams": 300.4, "name": "Tomatoes", "note": "Store it COLD.", "steps": ["Wash", "cut"]}
    assert _diff(expected, {**right, "tags": ["b", "A", "c"]}, rules) is None
    assert _diff(expected, {**right, "grams": 301, "tags": ["a"]}, rules) == "at grams: expected 300, got 301"
    wrong_name = _diff(expected, {**right, "name": "potato", "tags": ["a"]}, rules)
    assert wrong_name == 'at name: expected "tomato" or one of ["tomatoes", "cherry tomatoes"], got "potato"'
    assert _diff(expected, {**right, "note": "Keep dry", "tags": ["a"]}, rules) == (
        'at note: expected a text mentioning "cold", got "Keep dry"'
    )
    assert _diff(expected, {**right, "steps": ["cut", "wash"], "tags": ["a"]}, rules) == (
        'at steps/0: expected "wash", got "cut"'
    )
    assert _diff(expected, {**right, "tags": []}, rules) == "at tags: expected at least 1 items, got 0"
    # The same array without a rule: any order, the same number of items.
    assert _diff(["wash", "cut"], ["cut", "wash"]) is None
    # A tuple (prefixItems) is compared in order without a rule.
    tuple_schema = {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]}
    assert _diff([1, 2], [2, 1], schema=tuple_schema) == "at 0: expected 1, got 2"


def test_records_match_one_to_one_in_any_order() -> None:
    planets = [{"planet": p, "moons": n} for p, n in (("Mars", 2), ("Jupiter", 95), ("Neptune", 16))]
    shuffled = [{"moons": 16.0, "planet": "neptune"}, {"planet": "MARS", "moons": 2}, planets[1]]
    assert _diff(planets, shuffled) is None
    # Each answer item serves one reference item: two Mars rows do not stand for Mars and Neptune.
    twice = [planets[0], planets[1], planets[0]]
    assert _diff(planets, twice) == (
        'at (root): no item matches the expected {"planet": "Neptune", "moons": 16} '
        '(item 2 differs at 2/planet: expected "Neptune", got "Mars")'
    )
    # Item 0 accepts "a" or "b", item 1 only "b": answering ["b", "a"] needs item 0 moved to "a"
    # (an augmenting path), which a greedy first pick would miss.
    assert _diff(["a", "b"], ["b", "a"], {"/0": {"any_of": ["b"]}}) is None
    assert _diff(["a", "b"], ["b", "b"], {"/0": {"any_of": ["b"]}}) is None
    assert _diff(["a", "b"], ["a", "a"], {"/0": {"any_of": ["b"]}}) is not None
    # Rules for every item of an array (*) and for one (a concrete index wins).
    rules = {"/*/planet": {"substrings": ["a"]}, "/2/planet": {"any_of": ["Neptun"]}}
    renamed = [
        {"planet": "Ma", "moons": 2},
        {"planet": "Jupa", "moons": 95},
        {"planet": "neptun", "moons": 16},
    ]
    assert _diff(planets, list(reversed(renamed)), rules) is None


def test_a_shuffled_long_array_matches_in_bounded_work() -> None:
    """400 records in another order: matched (at most n*m comparisons), and a wrong one is found."""
    rng = random.Random(7)
    expected = [{"id": i, "name": f"item {i}"} for i in range(400)]
    answer = [dict(reversed(list(r.items()))) for r in expected]
    rng.shuffle(answer)
    assert _diff(expected, answer) is None
    answer[rng.randrange(400)]["name"] = "item x"
    assert (_diff(expected, answer) or "").startswith("at (root): no item matches the expected")


def test_content_free() -> None:
    assert content_free(
        {"title": "", "author": "  ", "year": 0, "genres": [], "x": {"y": [None, False, 0.0]}}
    )
    assert content_free([]) and content_free({}) and content_free("")
    assert not content_free({"title": "", "year": 0.5})
    assert not content_free({"flags": [False, True]})
    assert not content_free([{"name": "", "note": "x"}])


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"/genre": "contains"}, "no place in expected_document has this pointer"),
        ({"/title": "contains"}, "for an array"),
        ({"/tags": "sorted"}, "array must be one of ordered, unordered, contains"),
        ({"/tags": {"order": "any"}}, "a rule is one of"),
        ({"/title": {"tolerance": 1}}, "tolerance must be a number >= 0, for a number"),
        ({"/year": {"tolerance": -1}}, "tolerance must be a number >= 0"),
        ({"/title": {"substrings": []}}, "substrings must be a non-empty list"),
        ({"/title": {"substrings": ["  "]}}, "substrings must be a non-empty list of non-empty strings"),
        ({"/title": {"any_of": "Left Hand"}}, "any_of must be a non-empty list"),
        (["/title"], "expected_rules must be a mapping"),
    ],
)
def test_a_bad_rule_is_bad_data(rules: Any, message: str) -> None:
    with pytest.raises(InvalidReference, match=message):
        parse_rules(rules, BOOK)


def test_pointers_escape_and_wildcards() -> None:
    assert pointer([]) == "" and pointer(["a/b", "c~d", 3]) == "/a~1b/c~0d/3"
    assert pointer(["rows", 3, "x"], wildcard=True) == "/rows/*/x"
    expected = {"a/b": [{"x": 1}]}
    assert parse_rules({"/a~1b/*/x": {"tolerance": 0.1}, "": {"any_of": [{}]}}, expected)
    with pytest.raises(InvalidReference):
        parse_rules({"/a/b": "contains"}, expected)


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    }
)
REF = {"name": "Sonnblick", "n": 3106, "ok": True}


@pytest.mark.parametrize(
    ("schema_type", "text"),
    [
        ("json", '{"ok": true, "n": 3106.0, "name": "sonnblick"}'),
        ("yaml", "name:  SONNBLICK\nn: 3_106\nok: yes\n"),
        ("toml", 'n = 3106\nok = true\nname = "Sonnblick "\n'),
        ("xml", "<r><name>Sonnblick</name><n>3106</n><ok>1</ok></r>"),
    ],
)
def test_check_document_compares_the_schema_coerced_document(schema_type: str, text: str) -> None:
    schema, ref = SCHEMA, REF
    if schema_type == "xml":  # the root element wraps the object
        schema = json.dumps({"type": "object", "properties": {"r": json.loads(SCHEMA)}})
        ref = {"r": REF}
    assert check_document(schema, schema_type, text, expected_document=ref) == (1.0, None, None)
    wrong = text.replace("3106", "3107").replace("3_106", "3_107")
    reward, error_type, message = check_document(schema, schema_type, wrong, expected_document=ref)
    assert (reward, error_type) == (0.0, "content_mismatch") and "n: expected 3106, got 3107" in message


def test_check_document_content_rules_by_problem_type() -> None:
    empty = '{"name": "", "n": 0, "ok": false}'
    for problem_type in ("extraction", "document_extraction", "format_conversion"):
        reward, error_type, message = check_document(SCHEMA, "json", empty, problem_type=problem_type)
        assert (reward, error_type) == (
            0.0,
            "content_free",
        ) and "every value of the document is empty" in message
    # A row without a reference and of another kind keeps the form-only rule (upstream's).
    for problem_type in (None, "generation", "tool_call", "conversation"):
        assert check_document(SCHEMA, "json", empty, problem_type=problem_type) == (1.0, None, None)
    # A reference is checked only once the document follows the schema.
    assert check_document(SCHEMA, "json", '{"name": "x"}', expected_document=REF)[1] == "validation_error"
    with pytest.raises(InvalidReference):
        check_document(SCHEMA, "json", empty, expected_rules={"/name": "contains"})
