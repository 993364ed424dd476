"""mcqa: multiple-choice question answering, graded by the letter the model picks.

Contract
--------
* A row carries ``options`` (a list of one-key mappings ``{"A": "text"}``), ``expected_answer`` (the
  correct letter) and optionally ``grading_mode`` and ``template_metadata.output_regex``. Field names
  and grading modes are upstream NeMo Gym's (``resources_servers/mcqa``).
* Reward 1.0 iff the letter extracted from the final assistant text equals ``expected_answer``
  (case-insensitive); otherwise 0.0. The verify response adds ``extracted_answer`` (None when no
  letter could be read) and the upper-cased ``expected_answer``.
* Extraction, by grading mode (the server's ``grading_mode`` config key, when set, wins over the row's):
  - ``strict_single_letter_boxed`` (default): the content of the last ``\\boxed{...}`` is a single
    letter, possibly wrapped in ``\\text{}``, brackets or parentheses, or a letter followed by a label
    delimiter (``E: ...``, ``C) ...``).
  - ``lenient_boxed``: as strict; failing that, the boxed content contains the text of exactly one option.
  - ``lenient_answer_colon``: the text after the first ``Answer:`` is a single letter or exactly one
    option's text (case and whitespace ignored).
  - ``lenient_answer_colon_md``: the last ``Answer:`` line (markdown emphasis allowed) that yields one
    unambiguous letter; a list of several letters (``A, C``) yields none.
  A row's ``template_metadata.output_regex`` (one pattern or a list) is tried first; the last match of
  the first pattern that matches gives the letter (or an option's exact text).
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


_TEXT_WRAPPER = re.compile(r"\\text\{\s*(.*?)\s*\}", re.S)
_ONLY_LETTER = re.compile(r"^[^A-Za-z]*([A-Z])[^A-Za-z]*$")
_LETTER_THEN_LABEL = re.compile(r"^\s*([A-Z])\s*[:).\-]")
_ANSWER_COLON = re.compile(r"(?i)answer\s*:\s*(.+)")
_ANSWER_COLON_MD = re.compile(r"(?im)[*_]{0,2}Answer[*_]{0,2}\s*:[*_\s]{0,2}(.+)")
_SINGLE_LETTER = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")
_LEADING_LETTER = re.compile(r"^([a-zA-Z])(?![a-zA-Z0-9])")
_LAST_CAPITAL = re.compile(r"\b[A-Z]\b(?!.*\b[A-Z]\b)", re.S)
_LIST_GLUE = re.compile(r"(?:\s*[/|&,;]\s*|\s+(?:or|and)\s+|\s+)", re.I)
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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces counted), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed{"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[start + len("\\boxed{") : i]
            depth -= 1
    return None


def _unwrap_text(s: str) -> str:
    while (m := _TEXT_WRAPPER.fullmatch(s)) is not None:
        s = m.group(1)
    return s


def _strict_boxed(text: str, allowed: set[str]) -> str | None:
    inner = last_boxed(text)
    if inner is None:
        return None
    inner = _unwrap_text(inner.strip())
    m = _ONLY_LETTER.match(inner) or _LETTER_THEN_LABEL.match(inner)
    letter = m.group(1).upper() if m else None
    return letter if letter in allowed else None


def _boxed_option_text(text: str, options: list[dict[str, str | None]], allowed: set[str]) -> str | None:
    inner = last_boxed(text)
    if inner is None:
        return None
    candidates = {_squash(inner.strip()), _squash(_unwrap_text(inner.strip()))}
    hits = {
        letter for letter, opt in _option_texts(options, allowed) if opt and any(opt in c for c in candidates)
    }
    return hits.pop() if len(hits) == 1 else None


def _answer_colon(text: str, options: list[dict[str, str | None]], allowed: set[str]) -> str | None:
    m = _ANSWER_COLON.search(text)
    if m is None:
        return None
    candidate = _unwrap_text(m.group(1)).strip()
    if len(candidate) == 1 and candidate.isalpha() and candidate.upper() in allowed:
        return candidate.upper()
    wanted = _squash(candidate)
    return next((letter for letter, opt in _option_texts(options, allowed) if opt == wanted), None)


def _is_letter_list(text: str, allowed: set[str]) -> bool:
    found = [(m.group(1).upper(), m.span(1)) for m in _SINGLE_LETTER.finditer(text)]
    found = [f for f in found if f[0] in allowed]
    return any(
        a != b and _LIST_GLUE.fullmatch(text[sa[1] : sb[0]]) is not None
        for (a, sa), (b, sb) in zip(found, found[1:], strict=False)
    )


def _letter_of_payload(payload: str, allowed: set[str]) -> str | None:
    candidate = payload.translate(_LETTER_LOOKALIKES).strip().strip("*_` \t\n\r.,;:")
    if _is_letter_list(candidate, allowed):
        return None
    if len(candidate) == 1:
        letter: str | None = candidate
    else:
        m = _LEADING_LETTER.match(candidate) or _LAST_CAPITAL.search(candidate)
        letter = m.group(m.lastindex or 0) if m else None
    return letter.upper() if letter and letter.upper() in allowed else None


def _answer_colon_md(text: str, allowed: set[str]) -> str | None:
    for payload in reversed(_ANSWER_COLON_MD.findall(text)):
        if (letter := _letter_of_payload(payload, allowed)) is not None:
            return letter
    return None


def _custom_regex(
    text: str, patterns: str | list[str], options: list[dict[str, str | None]], allowed: set[str]
) -> str | None:
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        try:
            matches = re.findall(pattern, text, re.IGNORECASE)
        except re.error:
            continue
        if not matches:
            continue
        last = matches[-1]
        captured = (last[0] if isinstance(last, tuple) else last).strip().translate(_LETTER_LOOKALIKES)
        captured = captured.strip().upper()
        if len(captured) == 1 and captured.isalpha():
            return captured  # trusted even when not an option letter, as upstream
        wanted = _squash(captured)
        hit = next((letter for letter, opt in _option_texts(options, allowed) if opt == wanted), None)
        if hit is not None:
            return hit
    return None


def extract_answer(
    text: str,
    options: list[dict[str, str | None]],
    grading_mode: str,
    output_regex: str | list[str] | None = None,
) -> str | None:
    """The option letter the answer ``text`` picks under ``grading_mode``, or None."""
    allowed = option_letters(options)
    text = text.strip()
    if not text:
        return None
    if output_regex:
        if (letter := _custom_regex(text, output_regex, options, allowed)) is not None:
            return letter
    if grading_mode == "strict_single_letter_boxed":
        return _strict_boxed(text, allowed)
    if grading_mode == "lenient_boxed":
        return _strict_boxed(text, allowed) or _boxed_option_text(text, options, allowed)
    if grading_mode == "lenient_answer_colon":
        return _answer_colon(text, options, allowed)
    if grading_mode == "lenient_answer_colon_md":
        return _answer_colon_md(text, allowed)
    raise ValueError(f"unknown grading_mode {grading_mode!r}")


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
        predicted = extract_answer(body.response.output_text, body.options, mode, regex)
        return MCQAVerifyResponse.from_request(
            body,
            expected_answer=gold,
            extracted_answer=predicted,
            reward=1.0 if predicted is not None and predicted == gold else 0.0,
        )


if __name__ == "__main__":
    MCQAResourcesServer.run_webserver()
