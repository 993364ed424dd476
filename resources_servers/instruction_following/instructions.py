"""Verifiable instructions (IFEval's set, plus five from IFBench), written for this project.

``check(instruction_id, kwargs, response)`` says whether ``response`` follows the
instruction ``instruction_id`` with its arguments ``kwargs`` (the row's entry for it; ``None`` values
ignored). ``INSTRUCTION_IDS`` lists the ids known here; ``KWARGS`` each one's allowed arguments. An
unknown id or argument, or a missing required argument, raises :class:`BadInstruction` (bad data,
not a failed instruction). The semantics follow IFEval's published definitions (Zhou et al., 2023):
counts compared with ``relation`` "less than" (<) or "at least" (>=); paragraphs split on the
markdown divider ``***`` (or on blank lines for ``nth_paragraph_first_word``); words are runs of
word characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any


class BadInstruction(ValueError):
    """An instruction id or its arguments are not usable (a bad row)."""


_WORD = re.compile(r"\w+(?:'\w+)?")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])|\n\s*\n")
_ABBREVIATIONS = ("mr.", "mrs.", "ms.", "dr.", "prof.", "e.g.", "i.e.", "etc.", "vs.", "st.", "no.")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    """Sentences: split after . ! ? before a capital or digit (common abbreviations kept), and at blank lines."""
    parts: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        piece = text[start : m.start()].strip()
        if piece.lower().endswith(_ABBREVIATIONS):
            continue
        if piece:
            parts.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def _compare(count: int, relation: str, n: int) -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise BadInstruction(f"relation must be 'less than' or 'at least', got {relation!r}")


def _markdown_paragraphs(text: str) -> list[str]:
    return re.split(r"\s?\*\*\*\s?", text)


def _number_paragraphs(r: str, num_paragraphs: int) -> bool:
    parts = _markdown_paragraphs(r)
    parts = [p for i, p in enumerate(parts) if p.strip() or 0 < i < len(parts) - 1]
    return all(p.strip() for p in parts) and len(parts) == num_paragraphs


def _nth_paragraph_first_word(r: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Paragraphs split on blank lines; the first whitespace token of the nth, without quotes and
    ``. , ? ! ' "``, must be ``first_word`` (so "Crash—emotion" is not "crash", as in IFEval)."""
    paragraphs = [p for p in re.split(r"\n\n", r) if p.strip()]
    if len(paragraphs) != num_paragraphs or not 1 <= nth_paragraph <= len(paragraphs):
        return False
    tokens = paragraphs[nth_paragraph - 1].split()
    word = tokens[0].lstrip("'\"") if tokens else ""
    word = "".join(ch for ch in word if ch not in ".,?!'\"")
    return bool(word) and word.lower() == first_word.strip().lower()


def _highlights(r: str) -> int:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", r) if h.strip("*").strip()]
    double = [
        h for h in re.findall(r"\*\*[^\n\*]*\*\*", r) if h.removeprefix("**").removesuffix("**").strip()
    ]
    return len(single) + len(double)


def _sections(r: str, section_spliter: str, num_sections: int) -> bool:
    parts = re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", r)
    return len(parts) - 1 >= num_sections


def _json_format(r: str) -> bool:
    body = r.strip()
    body = re.sub(r"^```(?:json|JSON|Json)?\s*", "", body)
    body = re.sub(r"\s*```$", "", body).strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _title(r: str) -> bool:
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", r))


def _two_responses(r: str) -> bool:
    parts = r.split("******")
    parts = [p.strip() for i, p in enumerate(parts) if p.strip() or 0 < i < len(parts) - 1]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


def _language(r: str, language: str) -> bool:
    from langdetect import DetectorFactory, detect
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0
    try:
        return detect(r) == language
    except LangDetectException:
        return True  # nothing to detect (IFEval counts this as followed)


def _is_english(r: str) -> bool:
    return _language(r, "en")


def _capital_words(r: str) -> int:
    return sum(1 for w in words(r) if w.isupper())


def _postscript(r: str, postscript_marker: str) -> bool:
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return re.search(pattern, r.lower(), flags=re.MULTILINE) is not None


def _bullets(r: str) -> int:
    return len(re.findall(r"^\s*\*[^\*].*$", r, flags=re.MULTILINE)) + len(
        re.findall(r"^\s*-.*$", r, flags=re.MULTILINE)
    )


def _lowercase_counting(r: str, N: int) -> bool:
    """At most ``N`` all-lowercase words in the whole response (IFBench's rule: a total, not per word)."""
    return len(re.findall(r"\b[a-z]+\b", r)) <= N


def _letter_counting(r: str, N: int, relation: str) -> bool:
    return _compare(len(re.findall(r"[A-Za-z]", r)), relation, N)


def _two_markdown_paragraphs(r: str) -> bool:
    return _number_paragraphs(r, 2)


def _last_word(r: str, last_word: str) -> bool:
    tokens = r.split()
    return bool(tokens) and re.sub(r"[^\w]", "", tokens[-1]).lower() == last_word.strip().lower()


def _first_word_each_sentence(r: str, first_word: str) -> bool:
    """The first whitespace token of every sentence is ``first_word`` (case-insensitive; a token such
    as "Relationship-driven" is not "relationship", as in IFBench)."""
    found = sentences(r)
    return bool(found) and all(s.split()[0].strip().lower() == first_word.strip().lower() for s in found)


def _repeat_prompt(r: str, prompt_to_repeat: str) -> bool:
    return r.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _keyword_count(r: str, keyword: str) -> int:
    return len(re.findall(re.escape(keyword), r, flags=re.IGNORECASE))


# id -> (checker(response, **kwargs), required kwargs, optional kwargs)
_CHECKERS: dict[str, tuple[Callable[..., bool], tuple[str, ...], tuple[str, ...]]] = {
    "keywords:existence": (
        lambda r, keywords: all(re.search(re.escape(k), r, flags=re.IGNORECASE) for k in keywords),
        ("keywords",),
        (),
    ),
    "keywords:frequency": (
        lambda r, keyword, frequency, relation: _compare(_keyword_count(r, keyword), relation, frequency),
        ("keyword", "frequency", "relation"),
        (),
    ),
    "keywords:forbidden_words": (
        lambda r, forbidden_words: (
            not any(re.search(r"\b" + re.escape(w) + r"\b", r, flags=re.IGNORECASE) for w in forbidden_words)
        ),
        ("forbidden_words",),
        (),
    ),
    "keywords:letter_frequency": (
        lambda r, letter, let_frequency, let_relation: _compare(
            r.lower().count(letter.lower()), let_relation, let_frequency
        ),
        ("letter", "let_frequency", "let_relation"),
        (),
    ),
    "language:response_language": (_language, ("language",), ()),
    "length_constraints:number_sentences": (
        lambda r, num_sentences, relation: _compare(len(sentences(r)), relation, num_sentences),
        ("num_sentences", "relation"),
        (),
    ),
    "length_constraints:number_paragraphs": (_number_paragraphs, ("num_paragraphs",), ()),
    "length_constraints:number_words": (
        lambda r, num_words, relation: _compare(len(words(r)), relation, num_words),
        ("num_words", "relation"),
        (),
    ),
    "length_constraints:nth_paragraph_first_word": (
        _nth_paragraph_first_word,
        ("num_paragraphs", "nth_paragraph", "first_word"),
        (),
    ),
    "detectable_content:number_placeholders": (
        lambda r, num_placeholders: len(re.findall(r"\[.*?\]", r)) >= num_placeholders,
        ("num_placeholders",),
        (),
    ),
    "detectable_content:postscript": (_postscript, ("postscript_marker",), ()),
    "detectable_format:number_bullet_lists": (
        lambda r, num_bullets: _bullets(r) == num_bullets,
        ("num_bullets",),
        (),
    ),
    "detectable_format:constrained_response": (
        lambda r: any(o in r for o in ("My answer is yes.", "My answer is no.", "My answer is maybe.")),
        (),
        (),
    ),
    "detectable_format:number_highlighted_sections": (
        lambda r, num_highlights: _highlights(r) >= num_highlights,
        ("num_highlights",),
        (),
    ),
    "detectable_format:multiple_sections": (_sections, ("section_spliter", "num_sections"), ()),
    "detectable_format:json_format": (_json_format, (), ()),
    "detectable_format:title": (_title, (), ()),
    "combination:two_responses": (_two_responses, (), ()),
    "combination:repeat_prompt": (_repeat_prompt, ("prompt_to_repeat",), ()),
    "startend:end_checker": (
        lambda r, end_phrase: r.strip().lower().endswith(end_phrase.strip().lower()),
        ("end_phrase",),
        (),
    ),
    "startend:quotation": (lambda r: len(r.strip()) > 1 and r.strip()[0] == r.strip()[-1] == '"', (), ()),
    "change_case:capital_word_frequency": (
        lambda r, capital_frequency, capital_relation: _compare(
            _capital_words(r), capital_relation, capital_frequency
        ),
        ("capital_frequency", "capital_relation"),
        (),
    ),
    "change_case:english_capital": (lambda r: r.isupper() and _is_english(r), (), ()),
    "change_case:english_lowercase": (lambda r: r.islower() and _is_english(r), (), ()),
    "punctuation:no_comma": (lambda r: "," not in r, (), ()),
    # From IFBench (those used in upstream's example data).
    "count:lowercase_counting": (_lowercase_counting, ("N",), ()),
    "last_word:last_word_answer": (_last_word, ("last_word",), ()),
    "first_word:first_word_sent": (_first_word_each_sentence, ("first_word",), ()),
    "letters:letter_counting": (_letter_counting, ("N", "relation"), ()),
    "paragraphs:paragraphs": (_two_markdown_paragraphs, (), ()),
}

INSTRUCTION_IDS: tuple[str, ...] = tuple(sorted(_CHECKERS))
KWARGS: dict[str, tuple[str, ...]] = {k: v[1] + v[2] for k, v in _CHECKERS.items()}


def check(instruction_id: str, kwargs: dict[str, Any] | None, response: str) -> bool:
    """Whether ``response`` follows the instruction; :class:`BadInstruction` for an unusable one."""
    if instruction_id not in _CHECKERS:
        raise BadInstruction(f"unknown instruction id {instruction_id!r}")
    fn, required, optional = _CHECKERS[instruction_id]
    given = {k: v for k, v in (kwargs or {}).items() if v is not None}
    # Rows may carry arguments of other instructions (IFEval rows list the union); keep ours only.
    args = {k: v for k, v in given.items() if k in required + optional}
    missing = [k for k in required if k not in args]
    if missing:
        raise BadInstruction(f"instruction {instruction_id!r} needs kwargs {missing}, got {sorted(given)}")
    try:
        return bool(fn(response, **args))
    except (TypeError, AttributeError) as e:
        raise BadInstruction(f"instruction {instruction_id!r}: bad kwargs {args}: {e}") from None
