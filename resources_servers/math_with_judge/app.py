"""math_with_judge: math answers checked for symbolic equivalence (math-verify), optionally by an LLM judge.

Contract
--------
* A row carries ``question`` and ``expected_answer`` (upstream NeMo Gym's field names; both required,
  so a row without them is refused by ``ng_collect_rollouts`` before any rollout).
* The answer is the concatenated ``output_text`` of the response's assistant messages. math-verify
  extracts the last ``\\boxed{}`` (or a plain expression) and compares it with ``\\boxed{expected_answer}``
  (outer ``$...$`` / ``\\(...\\)`` stripped) symbolically. That runs in :mod:`nemo_gym.verify_pool`
  (a worker process's main thread: math-verify uses ``signal.alarm``), never on the event loop.
  ``library_reward`` is its verdict (1.0 / 0.0); ``extracted_answer`` the answer it read (or None).
* With ``should_use_judge: true`` a 0 from math-verify is re-checked by the judge model server
  (``judge_model_server``, any model server, possibly the policy): asked twice with the answers in
  both orders (to cancel position bias), reward 1.0 only when both verdicts are ``[[A=B]]``. The
  judge's requests and answers are returned in ``judge_evaluations``.
* Failures are never reward 0: a judge that cannot be reached or answers garbage raises
  :class:`~nemo_gym.judge.JudgeError` (the server answers 502; the collector records a failure).
  A judge reply without a verdict label is, by ``unparseable_verdict``: ``error`` (default) the same
  JudgeError, or ``metric`` a reward of 0.0 with ``judge_verdict_unparseable: true`` in the
  response (counted in aggregate metrics).
* A math-verify check that runs out of time (its own ``math_verify_timeout_seconds`` per parse /
  comparison, or ``library_verifier_timeout_seconds`` for the whole check, whose worker is then killed)
  is not a verdict. With ``should_use_judge: true`` the judge decides instead, as upstream does
  (``library_reward`` 0.0, ``extracted_answer`` None, the whole answer text goes to the judge, and
  ``library_verify_timed_out: true`` says so). Without a judge it is a
  :class:`~nemo_gym.verify_pool.VerifyTimeoutError`: HTTP 503 of kind ``verify_timeout`` (the rollout
  goes to the failures sidecar), never a 0 and never an unhandled 500. (Upstream scores it 0.0 when no
  judge is configured.) A check whose worker crashes is a 503 of kind ``verify_failed``; an
  ``expected_answer`` math-verify cannot parse is a server error (HTTP 500) naming the field. The
  pool's workers import math-verify in the background when the server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from typing import Any, ClassVar, Literal

from fastapi import HTTPException
from pydantic import BaseModel, Field, PositiveFloat

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
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.reward_profile import compute_pass_majority_metrics, highest_k_metrics
from nemo_gym.verify_pool import VerifyTimeoutError, get_verify_pool, run_in_verify_pool

JUDGE_SYSTEM_MESSAGE = (
    "You are a strict grader of math answers. You are shown a problem and two answers, A and B. "
    "Decide only whether A and B are mathematically the same answer (the same value, set or "
    "expression, in any notation); ignore formatting, working and wording. Your reply must end with "
    "a verdict label: the label of equivalent answers is [[A=B]] and the label of different answers "
    "is [[A!=B]]."
)
# The request for the verdict comes last, in prose: a small judge given a list of labels to end
# with tends to echo the first one whatever the answers.
JUDGE_PROMPT_TEMPLATE = (
    "<|Problem|>\n{question}\n\n"
    "<|Start of Answer A|>\n{first_answer}\n<|End of Answer A|>\n\n"
    "<|Start of Answer B|>\n{second_answer}\n<|End of Answer B|>\n\n"
    "Compare A and B in one sentence, then give the single label that applies."
)


class LibraryJudgeMathResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    judge_model_server: ModelServerRef | None = None
    judge_responses_create_params: NeMoGymResponseCreateParamsNonStreaming = Field(
        default_factory=lambda: NeMoGymResponseCreateParamsNonStreaming(input=[])
    )
    should_use_judge: bool = False
    # Bound on one whole check in the pool (a hung worker is killed). Past either bound: the judge
    # decides when should_use_judge, else HTTP 503 verify_timeout (never a 0).
    library_verifier_timeout_seconds: PositiveFloat = 30.0
    # math-verify's own bound on each parse / comparison.
    math_verify_timeout_seconds: int = Field(default=5, ge=1)
    unparseable_verdict: Literal["error", "metric"] = "error"
    judge_system_message: str = JUDGE_SYSTEM_MESSAGE
    judge_prompt_template: str = JUDGE_PROMPT_TEMPLATE
    judge_equal_label: str = "[[A=B]]"
    judge_not_equal_label: str = "[[A!=B]]"

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.should_use_judge and self.judge_model_server is None:
            raise ValueError("should_use_judge: true needs judge_model_server: {type, name}")


class LibraryJudgeMathRunRequest(BaseRunRequest):
    question: str
    expected_answer: str = Field(min_length=1)


class LibraryJudgeMathVerifyRequest(LibraryJudgeMathRunRequest, BaseVerifyRequest):
    pass


class JudgeEvaluation(BaseModel):
    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    response: NeMoGymResponse


class LibraryJudgeMathVerifyResponse(BaseVerifyResponse):
    expected_answer: str
    extracted_answer: str | None
    library_reward: float
    judge_evaluations: list[JudgeEvaluation] | None = None
    judge_verdict_unparseable: bool = False
    # math-verify ran out of time and the judge decided (only with should_use_judge).
    library_verify_timed_out: bool = False


def strip_math_delimiters(s: str) -> str:
    """``s`` without one outer ``\\(...\\)`` and one outer ``$...$``."""
    s = s.strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    if len(s) > 1 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    return s


_BAD_EXPECTED = "math-verify cannot parse expected_answer"


def math_verify_answer(
    expected_answer: str, generated_answer: str, timeout_seconds: int = 5
) -> tuple[float, str | None]:
    """(1.0 or 0.0, the extracted answer or None). Runs in a verify-pool worker (main thread).

    An ``expected_answer`` math-verify cannot parse raises ValueError (bad data is not a wrong answer:
    ``/verify`` answers 422 "bad row"). What it
    cannot read in the model's text is no answer; an error while comparing is no match. A parse or
    comparison that outlives ``timeout_seconds`` (math-verify's own ``signal.alarm``) raises
    :class:`VerifyTimeoutError`: on a loaded machine a right answer can time out, and that must not
    become a 0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    quiet = (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()))
    with quiet[0], quiet[1]:
        try:
            gold = parse(
                "\\boxed{" + strip_math_delimiters(expected_answer) + "}",
                extraction_config=[LatexExtractionConfig()],
                parsing_timeout=timeout_seconds,
                raise_on_error=True,
            )
        except TimeoutException as e:  # a BaseException: turn it into an error the caller reports
            raise VerifyTimeoutError(
                f"math-verify timed out parsing expected_answer {expected_answer!r}: {e}"
            ) from None
        if not gold:
            raise ValueError(f"{_BAD_EXPECTED} {expected_answer!r}")
        try:
            pred = parse(
                generated_answer,
                extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                parsing_timeout=timeout_seconds,
                raise_on_error=True,
            )
        except TimeoutException as e:
            raise VerifyTimeoutError(f"math-verify timed out parsing the answer: {e}") from None
        except Exception:  # text math-verify cannot turn into math: no answer
            pred = []
        try:
            ok = bool(pred) and verify(gold, pred, timeout_seconds=timeout_seconds, raise_on_error=True)
        except TimeoutException as e:
            raise VerifyTimeoutError(
                f"math-verify timed out comparing {pred[-1]!s:.200} with the expected answer: {e}"
            ) from None
        except Exception:  # sympy could not compare them: not shown equal
            ok = False
    extracted = str(pred[-1]) if pred else None
    return (1.0 if ok else 0.0), extracted


def warm_up_worker() -> float:
    """Import math-verify (sympy, the LaTeX grammar) in a pool worker before the first real answer."""
    return math_verify_answer("1", "\\boxed{1}")[0]


# Fields verify writes; dropped from the body first so a stored rollout can be verified again.
_VERIFY_OUTPUT_FIELDS = set(LibraryJudgeMathVerifyResponse.model_fields) - set(
    LibraryJudgeMathVerifyRequest.model_fields
)
_WARMUPS: list[asyncio.Task[float]] = []  # kept referenced until done


class LibraryJudgeMathResourcesServer(SimpleResourcesServer):
    config: LibraryJudgeMathResourcesServerConfig

    async def on_startup(self) -> None:
        await super().on_startup()
        # A cold worker spends seconds importing sympy; warm every worker now, in the background, so
        # the first answers' library_verifier_timeout_seconds measures verification, not imports.
        pool = get_verify_pool()
        _WARMUPS[:] = [
            asyncio.create_task(pool.run(warm_up_worker, timeout=300)) for _ in range(pool.max_workers)
        ]

    @judge_failsafe
    async def verify(self, body: LibraryJudgeMathVerifyRequest) -> LibraryJudgeMathVerifyResponse:
        text = "".join(
            part.text
            for item in body.response.output
            if item.type == "message"
            for part in item.content
            if part.type == "output_text"
        )
        timed_out = False
        try:
            library_reward, extracted = await run_in_verify_pool(
                math_verify_answer,
                body.expected_answer,
                text,
                self.config.math_verify_timeout_seconds,
                timeout=self.config.library_verifier_timeout_seconds,
            )
        except ValueError as e:  # the row's expected_answer (math_verify_answer): bad data, not a 0 or a 500
            if _BAD_EXPECTED not in str(e):
                raise
            raise HTTPException(422, f"bad row: {e}") from None
        except VerifyTimeoutError:
            if not self.config.should_use_judge:
                raise  # HTTP 503 verify_timeout (nemo_gym.server_utils): not scored
            # Upstream's fallback: math-verify gave no verdict, so the judge decides.
            library_reward, extracted, timed_out = 0.0, None, True
        reward, evaluations, unparseable = library_reward, None, False
        if self.config.should_use_judge and library_reward <= 0.5:
            reward, evaluations, unparseable = await self._judge(
                body.question, body.expected_answer, extracted or text
            )
        return LibraryJudgeMathVerifyResponse(
            **body.model_dump(exclude=_VERIFY_OUTPUT_FIELDS),
            reward=reward,
            extracted_answer=extracted,
            library_reward=library_reward,
            judge_evaluations=evaluations,
            judge_verdict_unparseable=unparseable,
            library_verify_timed_out=timed_out,
        )

    async def _judge(self, question: str, expected: str, generated: str) -> tuple[float, list, bool]:
        """Both orders; 1.0 only if both say equal (the second is skipped after a 'different')."""
        evaluations = []
        for first, second in ((expected, generated), (generated, expected)):
            verdict, evaluation = await self._one_verdict(question, first, second)
            evaluations.append(evaluation)
            if verdict is None:
                return 0.0, evaluations, True
            if not verdict:
                return 0.0, evaluations, False
        return 1.0, evaluations, False

    async def _one_verdict(
        self, question: str, first: str, second: str
    ) -> tuple[bool | None, JudgeEvaluation]:
        cfg = self.config
        assert cfg.judge_model_server is not None
        params = cfg.judge_responses_create_params.model_copy(deep=True)
        prompt = cfg.judge_prompt_template.format(question=question, first_answer=first, second_answer=second)
        params.input = [
            NeMoGymEasyInputMessage(role="system", content=cfg.judge_system_message),
            NeMoGymEasyInputMessage(role="user", content=prompt),
        ]
        response = await call_judge(
            self.server_client,
            server_name=cfg.judge_model_server.name,
            url_path="/v1/responses",
            json=params.model_dump(exclude_unset=True, mode="json"),
            response_model=NeMoGymResponse,
        )
        verdict_text = response.output_text
        eq, ne = verdict_text.find(cfg.judge_equal_label), verdict_text.find(cfg.judge_not_equal_label)
        verdict: bool | None = None
        if eq >= 0 or ne >= 0:  # the first label in the text wins
            verdict = eq >= 0 and (ne < 0 or eq < ne)
        evaluation = JudgeEvaluation(responses_create_params=params, response=response)
        if verdict is None and cfg.unparseable_verdict == "error":
            raise JudgeError(
                f"judge {cfg.judge_model_server.name!r} gave no verdict label "
                f"({cfg.judge_equal_label} or {cfg.judge_not_equal_label}): {verdict_text[:300]!r}",
                server=cfg.judge_model_server.name,
                path="/v1/responses",
            )
        return verdict, evaluation

    @staticmethod
    def _score(r: dict[str, Any]) -> dict[str, float]:
        scores = {"accuracy": r["reward"]}
        if "library_reward" in r:
            scores["symbolic_accuracy"] = r["library_reward"]
        if r.get("judge_evaluations") is not None:
            scores["judge_accuracy"] = r["reward"]
            scores["judge_verdict_unparseable"] = float(bool(r.get("judge_verdict_unparseable")))
            scores["library_verify_timed_out"] = float(bool(r.get("library_verify_timed_out")))
        return scores

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return compute_pass_majority_metrics(tasks, score_fn=self._score, answer_key="extracted_answer")[0]

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        key = {k: agent_metrics[k] for k in ("mean/reward",) if k in agent_metrics}
        names = ["accuracy", "symbolic_accuracy", "judge_accuracy", "no_answer"]
        key |= highest_k_metrics(agent_metrics, "pass@1[avg-of-{k}]", score_names=names)
        key |= highest_k_metrics(agent_metrics, "majority@{k}", score_names=["accuracy"])
        return key


if __name__ == "__main__":
    LibraryJudgeMathResourcesServer.run_webserver()
