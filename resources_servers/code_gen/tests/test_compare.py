"""code_gen's answer parsing and output comparison, in process (no sandbox): the edge cases right answers
depend on, and the near-misses a policy must not be paid for."""

from __future__ import annotations

import pytest

from resources_servers.code_gen.app import (
    SeveralProgramsError,
    extract_code,
    json_values_equal,
    stdout_matches,
)


@pytest.mark.parametrize(
    ("actual", "expected", "passed"),
    [
        ("3\n", "3\n", True),
        ("3.0", "3", True),  # an integral number written as a float is that integer
        ("  3  \n\n", "3\n", True),
        ("2000000001", "2000000000", False),  # within 1e-6 relative, but not the integer asked for
        ("2.880067194370816e+18", "2880067194370816120", False),
        ("2880067194370816000", "2880067194370816120", False),
        ("2_000", "2000", False),
        ("٣", "3", False),  # another script's digit
        ("0.33333333", "0.3333333333", True),  # an expected float: 1e-6 relative tolerance
        ("0.3334", "0.3333333333", False),
        ("nan", "nan", True),  # the same text
        ("nan", "0.5", False),
        ("inf", "1e308", False),
        ("first 0.3333333333", "first 0.333333333333", True),
        ("1 2", "1 2 3", False),
    ],
)
def test_stdout_tokens(actual: str, expected: str, passed: bool) -> None:
    assert stdout_matches(actual, expected) is passed


@pytest.mark.parametrize(
    ("got", "want", "passed"),
    [
        (3, 3, True),
        (3.0, 3, True),
        (3.0000001, 3, False),
        (True, 1, False),
        (False, 0, False),
        (1, True, False),
        (True, True, True),
        ([1, [2.0000001]], [1, [2.0]], True),  # floats inside lists keep the tolerance
        ([3], 3, False),
        (3, [3], False),
        ({"a": 1}, {"a": 1}, True),
        ({"a": True}, {"a": 1}, False),
        ("3", 3, False),
        (None, None, True),
        (float("nan"), 1.0, False),
    ],
)
def test_call_results(got: object, want: object, passed: bool) -> None:
    assert json_values_equal(got, want) is passed


def test_one_program_per_answer() -> None:
    code = "print(1)\n"
    assert extract_code(f"```python\n{code}```") == code
    assert (
        extract_code(f"```python\n{code}```\nagain:\n```python\n{code}```") == code
    )  # repeated: one program
    assert extract_code(f"example input:\n```\n1 2\n```\n```python\n{code}```") == code  # python blocks win
    assert extract_code("no code") is None
    with pytest.raises(SeveralProgramsError):
        extract_code(f"```python\n{code}```\n```python\nprint(2)\n```")
    with pytest.raises(SeveralProgramsError):
        extract_code("```\nprint(1)\n```\n```\nprint(2)\n```")
