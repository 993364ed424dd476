"""mcqa: multiple-choice question answering, graded by the letter the model picks.

Contract
--------
* A row carries ``options`` (a list of one-key mappings ``{"A": "text"}``), ``expected_answer`` (the
  correct letter) and optionally ``grading_mode`` and ``template_metadata.output_regex``. Field names
  and grading modes are upstream NeMo Gym's (``resources_servers/mcqa``).
* Reward 1.0 iff the answer (the concatenated ``output_text`` of the assistant messages; reasoning is
  not read) names exactly one option and it is ``expected_answer`` (case-insensitive); otherwise 0.0
  with ``failure_reason``: ``several different answers (...)``, ``no answer: ...`` or
  ``wrong answer: X``. The verify response adds ``extracted_answer`` (None when no single letter could
  be read) and the upper-cased ``expected_answer``.
* Extraction, by grading mode (the server's ``grading_mode`` config key, when set, wins over the row's):
  - ``strict_single_letter_boxed`` (default): each ``\\boxed{...}`` holds a single letter, possibly
    wrapped in ``\\text{}``, brackets or parentheses, or a letter followed by a label delimiter
    (``E: ...``, ``C) ...``).
  - ``lenient_boxed``: as strict; failing that, the box holds the text of exactly one option, as whole
    words.
  - ``lenient_answer_colon``: the text after ``Answer:`` is a single letter or exactly one option's
    text (case and whitespace ignored).
  - ``lenient_answer_colon_md``: ``Answer:`` lines (markdown emphasis allowed) that yield a letter; a
    list of several letters (``A, C``) yields them all.
  A row's ``template_metadata.output_regex`` (one pattern or a list) is tried first; every match of the
  first pattern that reads a letter (or an option's exact text) counts.
* One answer, one option: every box, ``Answer:`` line and regex match is read, and they must all name
  the same option. Boxes or lines that disagree, several labels in one box (``A. B. C. D.``,
  ``B) or C)``, ``B-D``) and hedges on one line (``(A) but it could be (C)``, ``C, or maybe A``) are a
  hedge: no answer. A ``\\boxed{`` left open, or an ``Answer:`` that names nothing beside others, makes
  the answer unreadable (no answer). (Upstream reads the last box, the first ``Answer:``, the last md
  line naming a letter or the last regex match, and the first label of ``A. B. C. D.``.)
* The letter must be one of the row's option letters (except through ``output_regex``, as upstream).
* Unlike upstream, ``options`` and ``expected_answer`` are required by mcqa's own ``/verify``: a row
  without them is refused by ``ng_collect_rollouts`` before any rollout, rather than scored 0. The
  shared request models (``MCQARunRequest``, ``MCQAVerifyRequest``) keep upstream's optional fields and
  upstream's helper names are here (``_get_allowed_letters_from_options``, ...), so environments built on
  upstream's mcqa (gpqa_diamond, bunsenbench_chemistry_mcq) run on this one unchanged.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.text import all_boxed, boxed_answers, unclosed_boxes
from nemo_gym.reward_profile import compute_pass_majority_metrics, highest_k_metrics

GradingMode = Literal[
    "strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon", "lenient_answer_colon_md"
]


class MCQAResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    # When set, overrides every row's grading_mode.
    grading_mode: GradingMode | None = None


class MCQARunRequest(BaseRunRequest):
    """Upstream's row shape: ``options`` and ``expected_answer`` may be absent here, since environments
    built on mcqa (gpqa_diamond) read the choices elsewhere. mcqa's own ``/verify`` requires both
    (:class:`MCQATaskVerifyRequest`)."""

    uuid: str | None = None
    options: list[dict[str, str | None]] | None = Field(
        default=None, description='The choices, one mapping per option: [{"A": "text"}, {"B": "text"}, ...].'
    )
    expected_answer: str | None = Field(default=None, description="The correct option letter.")
    metadata: dict[str, Any] | None = None
    grading_mode: GradingMode = "strict_single_letter_boxed"
    template_metadata: dict[str, Any] | None = None


class MCQAVerifyRequest(MCQARunRequest, BaseVerifyRequest):
    pass


class MCQATaskVerifyRequest(MCQAVerifyRequest):
    """mcqa's own ``/verify`` body: both grading fields required, so ``ng_collect_rollouts`` refuses a row
    without them before any rollout (its ``/row_schema`` says so) instead of scoring it 0."""

    options: list[dict[str, str | None]] = Field(
        description='The choices, one mapping per option: [{"A": "text"}, {"B": "text"}, ...].'
    )
    expected_answer: str = Field(min_length=1, description="The correct option letter.")


class MCQAVerifyResponse(BaseVerifyResponse):
    expected_answer: str
    extracted_answer: str | None
    # Why the reward is 0 (None when it is 1): no answer, several different answers, or a wrong one.
    failure_reason: str | None = None


_TEXT_WRAPPER = re.compile(r"\\text\{\s*(.*?)\s*\}", re.S)
_ONLY_LETTER = re.compile(r"^[^A-Za-z]*([A-Z])[^A-Za-z]*$")
_LETTER_THEN_LABEL = re.compile(r"^\s*([A-Z])\s*[:).\-]")
_ANSWER_COLON = re.compile(r"(?i)answer\s*:\s*(.+)")
_ANSWER_COLON_MD = re.compile(r"(?im)[*_]{0,2}Answer[*_]{0,2}\s*:[*_\s]{0,2}(.+)")
_SINGLE_LETTER = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")
_LEADING_LETTER = re.compile(r"^([a-zA-Z])(?![a-zA-Z0-9])")
_CAPITAL_WORD = re.compile(r"\b[A-Z]\b")
_LIST_GLUE = re.compile(r"(?:\s*[/|&,;]\s*|\s+(?:or|and)\s+|\s+)", re.I)
_STANDALONE_CAPITAL = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")
# After a letter: it is a label (``C)``, ``C]``, ``C:``, ``C.`` before more text).
_LABEL_AFTER = re.compile(r"\s*(?:[:)\]]|\.\s+\S)")
# After a letter that is the first thing past another option's label: nothing more, or punctuation
# (``B-D``, ``B. C.``, ``B, C``); ``B. A planet`` names only B.
_ALONE_AFTER = re.compile(r"\s*(?:$|[-\u2013\u2014.,;:/|&)\]])")
# Before a letter: list glue or a hedging word.
_HEDGE_BEFORE = re.compile(
    r"(?:[/|&,;]|\b(?:or|and|maybe|perhaps|possibly|probably|either|also|vs|versus))[\s*_`]*$", re.I
)
# Letters of other scripts and full-width forms that models write for A-D.
_LETTER_LOOKALIKES = str.maketrans(
    {"أ": " A", "ب": " B", "ج": " C", "د": " D", "অ": " A", "ব": " B", "ড": " C", "ঢ": " D"}
    | {"Ａ": " A", "Ｂ": " B", "Ｃ": " C", "Ｄ": " D"}
)


def option_letters(options: list[dict[str, str | None]]) -> set[str]:
    """The upper-case letters of the options that have a text."""
    return {
        k.upper()
        for entry in options
        for k, v in entry.items()
        if isinstance(k, str) and len(k) == 1 and k.isalpha() and v is not None
    }


def _option_texts(options: list[dict[str, str | None]], allowed: set[str]) -> list[tuple[str, str]]:
    return [
        (k.upper(), _squash(v))
        for entry in options
        for k, v in entry.items()
        if v is not None and k.upper() in allowed
    ]


def _squash(s: str) -> str:
    return " ".join(s.lower().split())


class Reading:
    """What an answer picks: one letter, none, or several different ones (a hedge, which scores 0)."""

    def __init__(self, letters: list[str | None] | None = None, problem: str | None = None) -> None:
        self.letters = [] if problem else sorted({x for x in letters or [] if x is not None})
        # Why the answer cannot be read at all (malformed markup), or None.
        self.problem = problem

    @property
    def letter(self) -> str | None:
        return self.letters[0] if len(self.letters) == 1 else None

    @property
    def hedged(self) -> bool:
        return len(self.letters) > 1


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces counted), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    boxes = all_boxed(text[start:])
    return boxes[0] if boxes else None


def _unwrap_text(s: str) -> str:
    while (m := _TEXT_WRAPPER.fullmatch(s)) is not None:
        s = m.group(1)
    return s


def _names_another(rest: str, letter: str, allowed: set[str]) -> bool:
    """Whether ``rest`` (what follows an option's label) names another option as a choice: as its first
    token (``B-D``, ``B. C.``), as a label (``C)``, ``(C)``, ``C:``, ``C. ``) or after list glue or a
    hedging word (``or C``, ``/ C``, ``maybe C``). ``B: Vitamin C`` names only B."""
    for m in _STANDALONE_CAPITAL.finditer(rest):
        other = m.group(1)
        if other == letter or other not in allowed:
            continue
        before, after = rest[: m.start()], rest[m.end() :]
        first = not before.strip(" \t\n\r-\u2013\u2014.,;:/|&()[]*_`")
        if (first and _ALONE_AFTER.match(after)) or _LABEL_AFTER.match(after) or _HEDGE_BEFORE.search(before):
            return True
    return False


def _box_letter(
    inner: str, options: list[dict[str, str | None]], allowed: set[str], lenient: bool
) -> Reading:
    inner = _unwrap_text(inner.strip())
    if (m := _ONLY_LETTER.match(inner)) is not None:
        return Reading([m.group(1)] if m.group(1) in allowed else [])
    if (m := _LETTER_THEN_LABEL.match(inner)) is not None and m.group(1) in allowed:
        rest = inner[m.end() :]
        if _names_another(rest, m.group(1), allowed):
            return Reading([m.group(1), *(x for x in _STANDALONE_CAPITAL.findall(rest) if x in allowed)])
        return Reading([m.group(1)])
    if not lenient:
        return Reading()
    candidates = {_squash(inner), _squash(_unwrap_text(inner))}
    return Reading(
        [
            letter
            for letter, opt in _option_texts(options, allowed)
            if opt and any(re.search(rf"(?<!\w){re.escape(opt)}(?!\w)", c) for c in candidates)
        ]
    )


def _boxed(text: str, options: list[dict[str, str | None]], allowed: set[str], lenient: bool) -> Reading:
    """Every box is read (a box nested in another on its own); boxes that name different options (or one
    box naming several) are a hedge."""
    if unclosed_boxes(text):
        return Reading(problem="a \\boxed{ is left open, so the answer's boxes cannot be told apart")
    letters: list[str | None] = []
    for inner in boxed_answers(text):
        reading = _box_letter(inner, options, allowed, lenient)
        letters += reading.letters
    return Reading(letters)


_SEVERAL_MARKERS = "several 'Answer:' markers, not all naming an option: an answer must give one"


def _strict_boxed(text: str, allowed: set[str]) -> str | None:
    return _boxed(text, [], allowed, lenient=False).letter


def _answer_colon(text: str, options: list[dict[str, str | None]], allowed: set[str]) -> Reading:
    letters: list[str | None] = []
    for m in _ANSWER_COLON.finditer(text):
        candidate = _unwrap_text(m.group(1)).strip()
        if len(candidate) == 1 and candidate.isalpha() and candidate.upper() in allowed:
            letters.append(candidate.upper())
            continue
        wanted = _squash(candidate)
        letters.append(
            next((letter for letter, opt in _option_texts(options, allowed) if opt == wanted), None)
        )
    if len(letters) > 1 and None in letters:
        return Reading(problem=_SEVERAL_MARKERS)
    return Reading(letters)


def _is_letter_list(text: str, allowed: set[str]) -> bool:
    found = [(m.group(1).upper(), m.span(1)) for m in _SINGLE_LETTER.finditer(text)]
    found = [f for f in found if f[0] in allowed]
    return any(
        a != b and _LIST_GLUE.fullmatch(text[sa[1] : sb[0]]) is not None
        for (a, sa), (b, sb) in zip(found, found[1:], strict=False)
    )


def _letter_of_payload(payload: str, allowed: set[str]) -> Reading:
    candidate = payload.translate(_LETTER_LOOKALIKES).strip().strip("*_` \t\n\r.,;:")
    if _is_letter_list(candidate, allowed):
        return Reading([m.upper() for m in _SINGLE_LETTER.findall(candidate) if m.upper() in allowed])
    if len(candidate) == 1:
        return Reading([candidate.upper()] if candidate.upper() in allowed else [])
    m = _LEADING_LETTER.match(candidate)
    capitals = _CAPITAL_WORD.findall(candidate) if m is None else []
    letter = m.group(1).upper() if m else (capitals[-1] if capitals else None)
    if letter is None or letter not in allowed:
        return Reading()
    if _names_another(candidate, letter, allowed):
        return Reading([letter, *(x for x in _STANDALONE_CAPITAL.findall(candidate) if x in allowed)])
    return Reading([letter])


def _answer_colon_md(text: str, allowed: set[str]) -> Reading:
    readings = [_letter_of_payload(payload, allowed) for payload in _ANSWER_COLON_MD.findall(text)]
    if len(readings) > 1 and any(not r.letters for r in readings):
        return Reading(problem=_SEVERAL_MARKERS)
    return Reading([letter for r in readings for letter in r.letters])


def _custom_regex_reading(
    text: str, patterns: str | list[str], options: list[dict[str, str | None]], allowed: set[str]
) -> Reading | None:
    """The letters the first pattern that reads one reads in ``text`` (each of its matches), or None
    when no pattern reads a letter."""
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        try:
            matches = re.findall(pattern, text, re.IGNORECASE)
        except re.error:
            continue
        letters: list[str | None] = []
        for match in matches:
            captured = (match[0] if isinstance(match, tuple) else match).strip().translate(_LETTER_LOOKALIKES)
            captured = captured.strip().upper()
            if len(captured) == 1 and captured.isalpha():
                letters.append(captured)  # trusted even when not an option letter, as upstream
                continue
            wanted = _squash(captured)
            letters.append(next((ltr for ltr, opt in _option_texts(options, allowed) if opt == wanted), None))
        if any(letters):
            return Reading(letters)
    return None


def _custom_regex(
    text: str, patterns: str | list[str], options: list[dict[str, str | None]], allowed: set[str]
) -> str | None:
    reading = _custom_regex_reading(text, patterns, options, allowed)
    return reading.letter if reading is not None else None


def read_answer(
    text: str,
    options: list[dict[str, str | None]],
    grading_mode: str,
    output_regex: str | list[str] | None = None,
) -> Reading:
    """Every option letter the answer ``text`` picks under ``grading_mode`` (one: its pick; several: a
    hedge; none: no answer)."""
    allowed = option_letters(options)
    text = text.strip()
    if not text:
        return Reading()
    if output_regex:
        if (reading := _custom_regex_reading(text, output_regex, options, allowed)) is not None:
            return reading
    if grading_mode == "strict_single_letter_boxed":
        return _boxed(text, options, allowed, lenient=False)
    if grading_mode == "lenient_boxed":
        return _boxed(text, options, allowed, lenient=True)
    if grading_mode == "lenient_answer_colon":
        return _answer_colon(text, options, allowed)
    if grading_mode == "lenient_answer_colon_md":
        return _answer_colon_md(text, allowed)
    raise ValueError(f"unknown grading_mode {grading_mode!r}")


def extract_answer(
    text: str,
    options: list[dict[str, str | None]],
    grading_mode: str,
    output_regex: str | list[str] | None = None,
) -> str | None:
    """The option letter the answer ``text`` picks under ``grading_mode``, or None (no answer, or an
    answer naming several options)."""
    return read_answer(text, options, grading_mode, output_regex).letter


_WHERE = {
    "strict_single_letter_boxed": "a \\boxed{} holding one option letter",
    "lenient_boxed": "a \\boxed{} holding one option letter or one option's text",
    "lenient_answer_colon": "an 'Answer:' naming one option letter or one option's exact text",
    "lenient_answer_colon_md": "an 'Answer:' line naming one option letter",
}


# Upstream NeMo Gym's helper names, which environments built on mcqa import (gpqa_diamond,
# bunsenbench_chemistry_mcq): same arguments and results, our implementation.


def _extract_options_and_expected(
    body: MCQARunRequest,
) -> tuple[list[dict[str, str | None]] | None, str | None]:
    """The row's ``options`` and ``expected_answer`` (the grading fields; ``metadata`` is never used)."""
    return body.options, body.expected_answer


def _get_allowed_letters_from_options(options: list[dict[str, str | None]] | None) -> set[str]:
    """:func:`option_letters`, with no options giving no letters."""
    return option_letters(options or [])


def _parse_answer_with_custom_regex(
    text: str, regex_pattern: str, allowed_letters: set[str], options: list[dict[str, str | None]] | None
) -> str | None:
    """The letter one ``output_regex`` pattern reads in ``text`` (its last match), or None."""
    return _custom_regex(text, regex_pattern, options or [], allowed_letters)


def _parse_answer_with_custom_regexes(
    text: str,
    regex_patterns: str | list[str],
    allowed_letters: set[str],
    options: list[dict[str, str | None]] | None,
) -> str | None:
    """The letter of the first of ``regex_patterns`` that reads one, or None."""
    return _custom_regex(text, regex_patterns, options or [], allowed_letters)


class MCQAResourcesServer(SimpleResourcesServer):
    config: MCQAResourcesServerConfig

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return compute_pass_majority_metrics(
            tasks, score_fn=lambda r: {"accuracy": r["reward"]}, answer_key="extracted_answer"
        )[0]

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        key = {k: agent_metrics[k] for k in ("mean/reward",) if k in agent_metrics}
        key |= highest_k_metrics(agent_metrics, "pass@1[avg-of-{k}]", score_names=["accuracy", "no_answer"])
        key |= highest_k_metrics(agent_metrics, "majority@{k}", score_names=["accuracy"])
        return key

    async def verify(self, body: MCQATaskVerifyRequest) -> MCQAVerifyResponse:  # type: ignore[override]
        gold = body.expected_answer.strip().upper()
        regex = (body.template_metadata or {}).get("output_regex")
        mode = self.config.grading_mode or body.grading_mode
        reading = read_answer(body.response.output_text, body.options, mode, regex)
        predicted = reading.letter
        if reading.problem is not None:
            reason = f"no answer: {reading.problem}"
        elif reading.hedged:
            reason = (
                f"several different answers ({', '.join(reading.letters)}): an answer must pick one option"
            )
        elif predicted is None:
            reason = f"no answer: expected {_WHERE[mode]}" + (" (or the row's output_regex)" if regex else "")
        elif predicted != gold:
            reason = f"wrong answer: {predicted}"
        else:
            reason = None
        return MCQAVerifyResponse.from_request(
            body,
            expected_answer=gold,
            extracted_answer=predicted,
            reward=1.0 if reason is None else 0.0,
            failure_reason=reason,
        )


if __name__ == "__main__":
    MCQAResourcesServer.run_webserver()
