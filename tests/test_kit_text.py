"""nemo_gym.kit.text.head_tail: what a model reads of a long tool output."""

from __future__ import annotations

from nemo_gym.kit.text import head_tail


def test_short_text_is_unchanged_and_a_long_one_keeps_its_head_and_tail_with_a_marker() -> None:
    assert head_tail("abc", 3) == "abc"
    assert head_tail("x" * 50 + "y" * 50, 20) == "x" * 10 + "\n[... 80 characters omitted ...]\n" + "y" * 10
    # An odd bound keeps max_chars // 2 at each end; the note can name the total.
    assert head_tail("0123456789", 5, "{cut} of {total} cut") == "01\n[... 6 of 10 cut ...]\n89"


def test_a_bound_below_two_keeps_no_text_but_still_says_what_was_cut() -> None:
    # text[-0:] would be the whole text: the tail is taken by index so nothing leaks past the bound.
    assert head_tail("abcdef", 1) == "\n[... 6 characters omitted ...]\n"
