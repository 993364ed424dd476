"""Text a model reads: a long tool output cut to its head and tail.

The model sees how a long output starts and ends (an error is usually at the end) and a marker saying
how much was cut, so it knows to narrow its command; the cut never happens silently.
"""

from __future__ import annotations


def head_tail(text: str, max_chars: int, note: str = "{cut} characters omitted") -> str:
    """``text`` as is when it has at most ``max_chars`` characters, else its first and last
    ``max_chars // 2`` around a line ``[... <note> ...]``; ``note`` may use ``{cut}`` (characters cut)
    and ``{total}`` (characters in ``text``)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    marker = note.format(cut=len(text) - 2 * half, total=len(text))
    return f"{text[:half]}\n[... {marker} ...]\n{text[len(text) - half :]}"
