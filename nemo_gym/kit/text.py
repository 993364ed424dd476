"""Text a model reads or writes: a long tool output cut to its head and tail; code blocks of an answer.

* :func:`head_tail`: the model sees how a long output starts and ends (an error is usually at the end)
  and a marker saying how much was cut, so it knows to narrow its command; the cut never happens silently.
* :func:`fenced_blocks` / :func:`last_code_block`: the fenced code blocks of a model's answer, in linear
  time whatever the text (an answer is hostile input: a regular expression that backtracks on unclosed
  fences would hold the event loop for minutes).
* :func:`bash_blocks`: the commands mini-swe-agent's default action regex (:data:`BASH_ACTION_PATTERN`)
  finds, the same matches in linear time.
* :func:`all_boxed` / :func:`boxed_answers` / :func:`unclosed_boxes`: an answer's ``\\boxed{...}`` (and,
  when asked, ``\\fbox{...}``) boxes with their braces counted, in one pass over the text (a long answer
  full of unclosed boxes costs no more than its length).
"""

from __future__ import annotations

import re

_LANG = re.compile(r"[ \t]*([\w+#.-]*)")
PYTHON_TAGS = frozenset({"python", "py", "python3"})
# The regular expression fenced_blocks replaces (it backtracks quadratically on unclosed fences).
FENCE_PATTERN = r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```"
# mini-swe-agent's default action regex (re.S): bash_blocks finds its matches without its backtracking.
BASH_ACTION_PATTERN = r"```bash[ \t]*\n(.*?)\n```"


def head_tail(text: str, max_chars: int, note: str = "{cut} characters omitted") -> str:
    """``text`` as is when it has at most ``max_chars`` characters, else its first and last
    ``max_chars // 2`` around a line ``[... <note> ...]``; ``note`` may use ``{cut}`` (characters cut)
    and ``{total}`` (characters in ``text``)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    marker = note.format(cut=len(text) - 2 * half, total=len(text))
    return f"{text[:half]}\n[... {marker} ...]\n{text[len(text) - half :]}"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block of ``text``, left to right: three backticks, the language
    (letters, digits and ``+#.-``) and the rest of that line, then the body up to the next three
    backticks. The blocks :data:`FENCE_PATTERN` finds (``re.S``), without its quadratic backtracking."""
    blocks = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        end = text.find("```", newline + 1) if newline >= 0 else -1
        if end < 0:  # nothing closes a block after this fence (nor after any later one)
            break
        match = _LANG.match(text, start + 3, newline)
        blocks.append((match.group(1) if match else "", text[newline + 1 : end]))
        pos = end + 3
    return blocks


def last_code_block(text: str | None) -> str | None:
    """The last fenced block of ``text`` (python-tagged ones first); None when there is none or it is
    blank."""
    blocks = [(lang.lower(), body) for lang, body in fenced_blocks(text or "")]
    python = [body for lang, body in blocks if lang in PYTHON_TAGS]
    chosen = python or [body for _, body in blocks]
    return chosen[-1] if chosen and chosen[-1].strip() else None


def bash_blocks(text: str) -> list[str]:
    """Group 1 of every match of :data:`BASH_ACTION_PATTERN` in ``text`` (``re.findall`` with ``re.S``),
    left to right, in linear time: an opener ```` ```bash ```` with only spaces or tabs before its newline,
    then the body up to the next newline followed by three backticks."""
    bodies = []
    pos = 0
    while (start := text.find("```bash", pos)) >= 0:
        i = start + 7
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text) or text[i] != "\n":
            pos = start + 1
            continue
        end = text.find("\n```", i + 1)
        if end < 0:  # nothing closes this block, nor any block after it
            break
        bodies.append(text[i + 1 : end])
        pos = end + 4
    return bodies


_BOX_TOKENS: dict[tuple[str, ...], re.Pattern[str]] = {}


def _box_tokens(commands: tuple[str, ...]) -> re.Pattern[str]:
    pattern = _BOX_TOKENS.get(commands)
    if pattern is None:
        pattern = _BOX_TOKENS[commands] = re.compile(
            r"\\(?:" + "|".join(map(re.escape, commands)) + r")\{|[{}]"
        )
    return pattern


def all_boxed(text: str, commands: tuple[str, ...] = ("boxed",)) -> list[str]:
    """The content of every closed box (``\\boxed{...}``; ``commands`` names the box commands), nested
    braces counted, in the order the boxes open; a box's content includes the boxes nested in it."""
    found: list[tuple[int, str]] = []
    frames: list[int] = []  # per open brace: where its box's content begins, or -1 for a plain brace
    for m in _box_tokens(commands).finditer(text):
        token = m.group()
        if token == "}":
            if frames and (begin := frames.pop()) >= 0:
                found.append((begin, text[begin : m.start()]))
        else:
            frames.append(m.end() if token != "{" else -1)
    return [content for _, content in sorted(found)]


def boxed_answers(text: str, commands: tuple[str, ...] = ("boxed",)) -> list[str]:
    """What every closed box says itself, in the order they open: its content without the boxes nested
    in it (those are answers of their own; ``\\boxed{\\boxed{B}}`` says only ``B``, and
    ``\\boxed{A \\boxed{B}}`` says ``A`` and ``B``)."""
    found: list[tuple[int, str]] = []
    frames: list[bool] = []  # per open brace: does it open a box?
    boxes: list[tuple[int, int, list[tuple[int, int]]]] = []  # open boxes: start, content start, children
    for m in _box_tokens(commands).finditer(text):
        token = m.group()
        if token == "}":
            if frames and frames.pop():
                start, begin, children = boxes.pop()
                parts, pos = [], begin
                for child_start, child_end in children:
                    parts.append(text[pos:child_start])
                    pos = child_end
                parts.append(text[pos : m.start()])
                found.append((start, "".join(parts)))
                if boxes:
                    boxes[-1][2].append((start, m.end()))
        elif token == "{":
            frames.append(False)
        else:
            frames.append(True)
            boxes.append((m.start(), m.end(), []))
    return [own for _, own in sorted(found)]


def unclosed_boxes(text: str, commands: tuple[str, ...] = ("boxed",)) -> int:
    """How many boxes of ``text`` open and never close (braces counted)."""
    frames: list[bool] = []
    for m in _box_tokens(commands).finditer(text):
        if m.group() == "}":
            if frames:
                frames.pop()
        else:
            frames.append(m.group() != "{")
    return sum(frames)
