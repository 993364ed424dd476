"""equivalence_llm_judge: short answers graded by an LLM judge against ``expected_answer``.

Contract (config keys and row fields as upstream NeMo Gym's ``equivalence_llm_judge``)
--------
* A row carries ``expected_answer`` (required) and optionally ``question`` (else the last user message,
  through ``question_extract_regex``), ``template_metadata.output_regex``, ``uuid``, ``options``,
  ``metadata``.
* The answer judged is the last assistant message's text, through ``response_extract_regex`` (or the
  row's ``output_regex`` when ``use_per_record_regex``; skipped for expected answers longer than
  ``extraction_length_threshold``): the last match, its first non-empty group, widened to the whole
  ``\\boxed{...}`` when the pattern cut a box short at an inner brace. No text: ``msg_extraction_failure``
  is judged instead. The judge sees at most the answer's last ``judge_max_answer_chars`` characters.
* Scored 0 without a judge call, with ``failure_reason`` (upstream judges all of these): with a pattern
  in force, an answer it does not match (or matches only emptily) is no answer; matches or boxes that
  give different answers, a box nested in a box, or a ``\\boxed{`` left open before another are a hedge;
  an answer containing a verdict label of the judge is an injection.
* The judge is any model server (``judge_model_server``), asked with ``judge_system_message`` and the
  template file ``judge_prompt_template_fpath`` (``{question}``, ``{expected_answer}``,
  ``{generated_answer}``; found next to this file or from the working directory). Its verdict is the
  first of ``judge_equal_label`` / ``judge_not_equal_label`` in its reply.
* Reward: equal -> 1.0; with ``check_twice_swap`` the judge is asked again with the answers swapped
  and a "different" then gives ``reward_if_swap_fails``. Not equal -> 0.0, unless
  ``check_full_generation_on_fail`` and the row has an ``output_regex``: the whole generation is
  judged again and "equal" gives ``reward_if_full_generation_succeeds``. ``judge_evaluations`` holds
  every judge request, reply and ``verdict_label``.
* Failures are never reward 0 (upstream folds an unparseable verdict into 0): a judge that cannot be
  reached or answers garbage is a :class:`~nemo_gym.judge.JudgeError` (HTTP 502, the rollout goes to
  the failures file); a reply without a label is, by ``unparseable_verdict``: ``error`` (default) the
  same, or ``metric``: reward 0.0 with ``judge_verdict_unparseable: true``. ``failure_reason`` says why
  a reward is 0 (None when it is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.config_types import ModelServerRef
from nemo_gym.judge import JudgeError, call_judge, judge_failsafe
from nemo_gym.kit.text import boxed_answers, unclosed_boxes
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)

HERE = Path(__file__).resolve().parent


class LLMJudgeResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    judge_model_server: ModelServerRef
    judge_responses_create_params: NeMoGymResponseCreateParamsNonStreaming = Field(
        default_factory=lambda: NeMoGymResponseCreateParamsNonStreaming(input=[])
    )
    judge_endpoint_max_concurrency: int | None = Field(default=64, ge=1)
    judge_system_message: str | None = None
    judge_prompt_template_fpath: str = "prompt_templates/equivalence_llm_judge.txt"
    judge_equal_label: str = "[[A=B]]"
    judge_not_equal_label: str = "[[A!=B]]"
    question_extract_regex: str | None = None
    response_extract_regex: str | None = None
    msg_extraction_failure: str = "[NO VALID ANSWER EXTRACTED]"
    check_twice_swap: bool = False
    reward_if_swap_fails: float = 0.0
    use_per_record_regex: bool = True
    extraction_length_threshold: int | None = 120
    check_full_generation_on_fail: bool = True
    reward_if_full_generation_succeeds: float = 0.5
    unparseable_verdict: Literal["error", "metric"] = "error"
    # What the judge is shown of an answer: at most its last this-many characters.
    judge_max_answer_chars: int = Field(default=20_000, ge=1)


class LLMJudgeRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")

    uuid: str | int | None = None
    question: str | None = None
    expected_answer: str = Field(min_length=1)
    options: list[dict[str, str]] | None = None
    metadata: dict[str, Any] | None = None
    template_metadata: dict[str, Any] | None = None


class LLMJudgeVerifyRequest(LLMJudgeRunRequest, BaseVerifyRequest):
    pass


class JudgeEvaluation(BaseModel):
    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    response: NeMoGymResponse
    verdict_label: str | None = None


class LLMJudgeVerifyResponse(BaseVerifyResponse):
    expected_answer: str
    judge_evaluations: list[JudgeEvaluation]
    judge_verdict_unparseable: bool = False
    # Why the reward is 0 (None when it is not).
    failure_reason: str | None = None


class _Unparseable(Exception):
    """A judge reply with no verdict label (``unparseable_verdict: metric`` turns it into a field)."""

    def __init__(self, evaluations: list[JudgeEvaluation]) -> None:
        super().__init__("no verdict label")
        self.evaluations = evaluations


def last_match(text: str, pattern: str | None) -> str:
    """The last match of ``pattern`` in ``text`` (its first non-empty group, else the match); ``text``
    itself without a pattern, a match, or with an invalid pattern."""
    found = all_matches(text, pattern)
    return found[-1] if found else text


def all_matches(text: str, pattern: str | None) -> list[str] | None:
    """What every match of ``pattern`` in ``text`` captured (its first non-empty group; "" when all its
    groups are empty; the whole match for a pattern without groups), in order; None without a usable
    pattern (none, or one that does not compile)."""
    if not pattern:
        return None
    try:
        matches = list(re.finditer(pattern, text, flags=re.MULTILINE | re.DOTALL))
    except re.error:
        return None
    return [
        next((g.strip() for g in m.groups() if isinstance(g, str) and g.strip()), "")
        if m.groups()
        else m.group(0).strip()
        for m in matches
    ]


def judged_answer(text: str, pattern: str | None) -> str:
    """The answer the judge sees: :func:`last_match`, widened to the whole box when the pattern cut a box
    short at an inner brace (``\\boxed{\\frac{1}{2}}``: ``\\frac{1}{2}``, not ``\\frac{1``; and
    ``\\boxed{\\text{A} or B}`` shows the judge its ``or B``)."""
    answer = last_match(text, pattern)
    if not pattern:
        return answer
    for box in reversed([b.strip() for b in boxed_answers(text)]):
        if box and (box.startswith(answer) or "\\boxed{" in answer):
            return box
    return answer


def _same(answer: str) -> str:
    return " ".join(answer.split()).lower()


def tail(text: str, limit: int) -> str:
    """``text``, or its last ``limit`` characters after a note that the rest was cut."""
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit:,} earlier characters cut ...]\n" + text[-limit:]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = [getattr(c, "text", None) if not isinstance(c, dict) else c.get("text") for c in content or []]
    return "\n".join(p for p in parts if isinstance(p, str))


class LLMJudgeResourcesServer(SimpleResourcesServer):
    config: LLMJudgeResourcesServerConfig
    _template: str = PrivateAttr(default="")
    _judge_slots: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        path = Path(self.config.judge_prompt_template_fpath)
        candidates = [path] if path.is_absolute() else [HERE / path, Path.cwd() / path]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise ValueError(
                f"judge_prompt_template_fpath {self.config.judge_prompt_template_fpath!r}: no such file "
                f"(looked in {', '.join(str(c) for c in candidates)})"
            )
        self._template = found.read_text().strip()
        limit = self.config.judge_endpoint_max_concurrency
        self._judge_slots = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

    @judge_failsafe
    async def verify(self, body: LLMJudgeVerifyRequest) -> LLMJudgeVerifyResponse:
        cfg = self.config
        expected = body.expected_answer
        question = body.question or self._question(body)
        per_record = (body.template_metadata or {}).get("output_regex") if cfg.use_per_record_regex else None
        long_answer = (
            cfg.extraction_length_threshold is not None and len(expected) > cfg.extraction_length_threshold
        )
        pattern = cfg.response_extract_regex
        if per_record:
            pattern = None if long_answer else per_record
        full = self._answer_text(body)
        evaluations: list[JudgeEvaluation] = []
        reward, unparseable = 0.0, False
        refusal = self._refusal(full, pattern) if full else None
        if refusal is None:
            generated = judged_answer(full, pattern) if full else cfg.msg_extraction_failure
            generated = tail(generated, cfg.judge_max_answer_chars)
            try:
                equal = await self._verdict(question, expected, generated, evaluations)
                if equal:
                    reward = 1.0
                    if cfg.check_twice_swap and not (per_record and long_answer):
                        swapped = await self._verdict(question, generated, expected, evaluations)
                        reward = 1.0 if swapped else cfg.reward_if_swap_fails
                elif per_record and not long_answer and cfg.check_full_generation_on_fail:
                    rescue = tail(full or cfg.msg_extraction_failure, cfg.judge_max_answer_chars)
                    if await self._verdict(question, expected, rescue, evaluations):
                        reward = cfg.reward_if_full_generation_succeeds
            except _Unparseable:
                reward, unparseable = 0.0, True
        reason = refusal
        if reward <= 0 and reason is None:
            reason = (
                "the judge's reply had no verdict label (unparseable_verdict: metric)"
                if unparseable
                else "the judge found the answer different from the expected one"
            )
        fields = body.model_dump(
            exclude={
                "expected_answer",
                "reward",
                "judge_evaluations",
                "judge_verdict_unparseable",
                "failure_reason",
            }
        )
        return LLMJudgeVerifyResponse(
            **fields,
            expected_answer=expected,
            reward=reward,
            judge_evaluations=evaluations,
            judge_verdict_unparseable=unparseable,
            failure_reason=reason if reward <= 0 else None,
        )

    def _refusal(self, text: str, pattern: str | None) -> str | None:
        """Why ``text`` is scored 0 without asking the judge (None: the judge decides).

        One answer: the pattern's matches must agree, a box nested in or left open before another is
        a hedge, boxes must agree; with a pattern that matches nothing the answer is not in the asked
        format. And an answer that writes the judge's verdict labels is an injection, not an answer."""
        cfg = self.config
        matches = all_matches(text, pattern)
        if matches is not None:
            if not matches:
                return f"no answer: nothing in the answer matches the answer format ({pattern[:80]!r})"
            if not any(matches):
                return "no answer: the answer's match of the answer format is empty"
            if unclosed_boxes(text):
                return (
                    "several different answers: a \\boxed{ is left open, so its answer cannot be told apart"
                )
            # Matches that run into a nested box (``\\boxed{A \\boxed{B}}``) are read as the boxes are,
            # each on its own; a box the pattern cut short at an inner brace (``\\text{Canberra`` of
            # ``\\boxed{\\text{Canberra}}``) is the same answer.
            found = list(dict.fromkeys(_same(m) for m in matches if m and "\\boxed{" not in m))
            found += [
                b
                for b in dict.fromkeys(_same(b) for b in boxed_answers(text))
                if b and not any(b.startswith(m) for m in found)
            ]
            if len(found) > 1:
                shown = ", ".join(repr(a[:40]) for a in found[:4]) + (", ..." if len(found) > 4 else "")
                return f"several different answers ({shown}): an answer must give one"
        for label in (cfg.judge_equal_label, cfg.judge_not_equal_label):
            if label in text:
                return f"the answer contains the judge's verdict label {label}: it is not sent to the judge"
        return None

    def _question(self, body: LLMJudgeVerifyRequest) -> str:
        params = body.responses_create_params
        items = [params.input] if isinstance(params.input, str) else list(params.input or [])
        users = [
            i for i in items if (i.get("role") if isinstance(i, dict) else getattr(i, "role", None)) == "user"
        ]
        if isinstance(params.input, str):
            text = params.input
        elif users:
            last = users[-1]
            text = _text_of(last.get("content") if isinstance(last, dict) else getattr(last, "content", ""))
        else:
            text = ""
        text = text.strip()
        return last_match(text, self.config.question_extract_regex) if text else text

    @staticmethod
    def _answer_text(body: LLMJudgeVerifyRequest) -> str:
        for item in reversed(body.response.output):
            if item.type == "message" and getattr(item, "role", "assistant") == "assistant":
                return _text_of(item.content).strip()
        return ""

    async def _verdict(
        self, question: str, first: str, second: str, evaluations: list[JudgeEvaluation]
    ) -> bool:
        cfg = self.config
        params = cfg.judge_responses_create_params.model_copy(deep=True)
        prompt = self._template.format(question=question, expected_answer=first, generated_answer=second)
        messages = (
            [NeMoGymEasyInputMessage(role="system", content=cfg.judge_system_message)]
            if cfg.judge_system_message
            else []
        )
        params.input = [*messages, NeMoGymEasyInputMessage(role="user", content=prompt)]
        async with self._judge_slots:
            reply = await call_judge(
                self.server_client,
                server_name=cfg.judge_model_server.name,
                url_path="/v1/responses",
                json=params.model_dump(exclude_unset=True, mode="json"),
                response_model=NeMoGymResponse,
            )
        text = reply.output_text
        eq, ne = text.find(cfg.judge_equal_label), text.find(cfg.judge_not_equal_label)
        label = None
        if eq >= 0 and (ne < 0 or eq < ne):
            label = cfg.judge_equal_label
        elif ne >= 0:
            label = cfg.judge_not_equal_label
        evaluations.append(
            JudgeEvaluation(responses_create_params=params, response=reply, verdict_label=label)
        )
        if label is None:
            if cfg.unparseable_verdict == "metric":
                raise _Unparseable(evaluations)
            raise JudgeError(
                f"judge {cfg.judge_model_server.name!r} gave no verdict label "
                f"({cfg.judge_equal_label} or {cfg.judge_not_equal_label}): {text[:300]!r}",
                server=cfg.judge_model_server.name,
                path="/v1/responses",
            )
        return label == cfg.judge_equal_label

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        rollouts = [r for rs in tasks for r in rs]
        if not rollouts:
            return {}
        return {
            "judge_verdict_unparseable_rate": sum(bool(r.get("judge_verdict_unparseable")) for r in rollouts)
            / len(rollouts),
            "judge_calls_per_rollout": sum(len(r.get("judge_evaluations") or []) for r in rollouts)
            / len(rollouts),
        }


if __name__ == "__main__":
    LLMJudgeResourcesServer.run_webserver()
