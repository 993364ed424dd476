"""nemo_gym.kit.text: what a model reads of a long tool output; the code blocks of a model's answer."""

from __future__ import annotations

import random
import re

from nemo_gym.kit.text import (
    BASH_ACTION_PATTERN,
    FENCE_PATTERN,
    all_boxed,
    bash_blocks,
    boxed_answers,
    fenced_blocks,
    head_tail,
    last_code_block,
    unclosed_boxes,
)


def test_short_text_is_unchanged_and_a_long_one_keeps_its_head_and_tail_with_a_marker() -> None:
    assert head_tail("abc", 3) == "abc"
    assert head_tail("x" * 50 + "y" * 50, 20) == "x" * 10 + "\n[... 80 characters omitted ...]\n" + "y" * 10
    # An odd bound keeps max_chars // 2 at each end; the note can name the total.
    assert head_tail("0123456789", 5, "{cut} of {total} cut") == "01\n[... 6 of 10 cut ...]\n89"


def test_a_bound_below_two_keeps_no_text_but_still_says_what_was_cut() -> None:
    # text[-0:] would be the whole text: the tail is taken by index so nothing leaks past the bound.
    assert head_tail("abcdef", 1) == "\n[... 6 characters omitted ...]\n"


def test_fenced_blocks_are_the_patterns_blocks_in_linear_time() -> None:
    pattern = re.compile(FENCE_PATTERN, re.S)
    rng = random.Random(0)
    pieces = ["`", "``", "```", "\n", " ", "\t", "py", "python", "x", "+#.-", "a b"]
    for _ in range(20_000):  # the same blocks as the expression, on every shape of text
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert fenced_blocks(text) == pattern.findall(text), repr(text)
    answer = "Here:\n```text\nnot code\n```\n```python\nx = 1\n```\n```sh\nls\n```\n"
    assert last_code_block(answer) == "x = 1\n"  # python-tagged first
    assert last_code_block("```\n   \n```") is None and last_code_block(None) is None
    # A model's answer of unclosed fences: the expression backtracks quadratically on it (hours for
    # 3 MB); the scan is linear.
    assert fenced_blocks("```" * 1_000_000) == []
    assert fenced_blocks("```py\n" + "```" * 1_000_000) == [("py", "")]


def test_bash_blocks_are_the_default_action_regex_matches_in_linear_time() -> None:
    pattern = re.compile(BASH_ACTION_PATTERN, re.S)
    rng = random.Random(1)
    pieces = ["```bash", "```", "\n", " ", "\t", "x", "bash", "`", "```bash \n", "ls\n"]
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert bash_blocks(text) == pattern.findall(text), repr(text)
    assert bash_blocks("Run it:\n```bash\nls -la\n```\nthen\n```bash  \n\n```") == ["ls -la", ""]
    # 1 MB of unclosed openers: hours for the expression (bash_agent's default, on its event loop before),
    # one pass here.
    assert bash_blocks("```bash\nx" * 110_000) == []


def test_boxes_are_read_with_their_braces_counted_in_one_pass() -> None:
    text = r"First \boxed{A \boxed{B}} then \boxed{\frac{1}{2}} and \fbox{C} and \boxed{D"
    assert all_boxed(text) == [r"A \boxed{B}", "B", r"\frac{1}{2}"]
    assert boxed_answers(text) == ["A ", "B", r"\frac{1}{2}"]  # a nested box is an answer of its own
    assert boxed_answers(text, ("boxed", "fbox")) == ["A ", "B", r"\frac{1}{2}", "C"]
    assert unclosed_boxes(text) == 1 and unclosed_boxes("{ } }") == 0
    # 1 MB of unclosed boxes: no box is read, in one pass.
    assert all_boxed("\\boxed{" * 150_000) == [] and unclosed_boxes("\\boxed{" * 150_000) == 150_000
