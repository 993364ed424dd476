"""math_with_judge: math answers checked for symbolic equivalence (math-verify), optionally by an LLM judge.

Contract
--------
* A row carries ``question`` and ``expected_answer`` (upstream NeMo Gym's field names; both required,
  so a row without them is refused by ``ng_collect_rollouts`` before any rollout).
* The answer is the concatenated ``output_text`` of the response's assistant messages. math-verify
  extracts the ``\\boxed{}``es (or a plain expression) and compares it with ``\\boxed{expected_answer}``
  (outer ``$...$`` / ``\\(...\\)`` stripped) symbolically. That runs in :mod:`nemo_gym.kit.verify_pool`
  (a worker process's main thread: the CPU-time bound is a signal timer), never on the event loop.
  ``library_reward`` is its verdict (1.0 / 0.0); ``extracted_answer`` the answer it read (or None).
* ``should_use_judge`` defaults to true when a ``judge_model_server`` is configured (upstream's default),
  else false. With ``should_use_judge: true`` a 0 from math-verify is re-checked by the judge model server
  (``judge_model_server``, any model server, possibly the policy): asked twice with the answers in
  both orders (to cancel position bias), reward 1.0 only when both verdicts are ``[[A=B]]``. The
  judge's requests and answers are returned in ``judge_evaluations``.
* Failures are never reward 0: a judge that cannot be reached or answers garbage raises
  :class:`~nemo_gym.judge.JudgeError` (the server answers 502; the collector records a failure).
  A judge reply without a verdict label is, by ``unparseable_verdict``: ``error`` (default) the same
  JudgeError, or ``metric`` a reward of 0.0 with ``judge_verdict_unparseable: true`` in the
  response (counted in aggregate metrics).
* An answer math-verify cannot check within its bounds is the model's doing, scored, never a 503: its
  own ``math_verify_timeout_seconds`` on a parse or comparison of the answer, the whole check killed
  past ``library_verifier_timeout_seconds`` twice in a row (once more on a fresh worker), or a worker
  dying on the answer twice give ``library_reward`` 0.0, ``extracted_answer`` None and
  ``library_verify_timed_out: true``. With ``should_use_judge: true`` the judge then decides, as
  upstream does; without one the reward is 0.0 with its ``failure_reason``. Only math-verify running
  out of time on the row's ``expected_answer`` is a :class:`~nemo_gym.kit.verify_pool.VerifyTimeoutError`
  (HTTP 503 ``verify_timeout``); an ``expected_answer`` math-verify cannot parse is the row's fault
  (HTTP 422 "bad row" naming the field). The pool's workers import math-verify in the background when
  the server starts.
* A box stating an equality of two numbers that is false (``360 = 720``, ``x = 360 = 720``; math-verify
  compares an equation's right side alone) is 0.0, and no judge may overturn it. An answer math-verify
  rejects goes to no judge when it has no text, boxes several different answers, or carries one of the
  judge's verdict labels; the judge sees what math-verify extracted, else the answer's last
  ``judge_max_answer_chars`` characters.
* An answer with a ``\\boxed{`` left open is no answer (0, nothing is run): which box holds the answer
  cannot be told (a megabyte of unclosed boxes before the right one is not that answer).
* ``failure_reason`` says why a reward is 0 (None when it is not).
* The verify runs through upstream's hooks (names, arguments and results as upstream's), so an
  environment subclassing upstream's server overrides them here unchanged: see
  :class:`LibraryJudgeMathResourcesServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi import HTTPException
from pydantic import BaseModel, Field, PositiveFloat, PositiveInt

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
from nemo_gym.kit import text as _text
from nemo_gym.kit.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    get_verify_pool,
    run_in_verify_pool,
)
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.reward_profile import compute_pass_majority_metrics, highest_k_metrics

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
    # Unset: true when a judge_model_server is configured (upstream's default is true, with the judge required).
    should_use_judge: bool | None = None
    # Bound on one whole check in the pool (a hung worker is killed). Past either bound: the judge
    # decides when should_use_judge, else HTTP 503 verify_timeout (never a 0).
    library_verifier_timeout_seconds: PositiveFloat = 30.0
    # The bound on each parse / comparison, in CPU seconds (cpu_time_bound; upstream: wall-clock seconds).
    math_verify_timeout_seconds: int = Field(default=5, ge=1)
    unparseable_verdict: Literal["error", "metric"] = "error"
    # Unset: the server class's JUDGE_* constants (a subclass may override those, as upstream's do).
    judge_system_message: str | None = None
    judge_prompt_template: str | None = None
    judge_equal_label: str | None = None
    judge_not_equal_label: str | None = None
    # What the judge is shown of an answer math-verify read nothing in: its last this-many characters.
    judge_max_answer_chars: PositiveInt = 20_000
    # At most this many math-verify checks of this server at once (upstream's key; the verify pool's
    # size bounds the whole process).
    library_verifier_max_concurrency: PositiveInt = 32

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.should_use_judge is None:
            self.should_use_judge = self.judge_model_server is not None
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
    # math-verify ran out of time on the answer (the judge decided, or without one: a 0).
    library_verify_timed_out: bool = False
    # Why the reward is 0 (None when it is not).
    failure_reason: str | None = None


def strip_math_delimiters(s: str) -> str:
    """``s`` without one outer ``\\(...\\)`` and one outer ``$...$``."""
    s = s.strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    if len(s) > 1 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    return s


_BAD_EXPECTED = "math-verify cannot parse expected_answer"


# What a check in the pool found besides its verdict (math_verify_check's third value).
ANSWER_TIMEOUT = "answer_timeout"  # math-verify ran out of time on the model's answer: scored, never a 503
FALSE_EQUATION = "false_equation"  # the answer's box states an equality of two numbers that is false
EXPECTED_TIMEOUT = "expected_timeout"  # math-verify ran out of time on the row's expected_answer: 503


def math_verify_answer(
    expected_answer: str, generated_answer: str, timeout_seconds: int = 5
) -> tuple[float, str | None]:
    """(1.0 or 0.0, the extracted answer or None): :func:`math_verify_check` without its note (an answer
    math-verify ran out of time on is 0.0; an ``expected_answer`` it ran out of time on raises
    :class:`VerifyTimeoutError`)."""
    reward, extracted, note = math_verify_check(expected_answer, generated_answer, timeout_seconds)
    if note is not None and note[0] == EXPECTED_TIMEOUT:
        raise VerifyTimeoutError(note[1])
    return reward, extracted


def math_verify_check(
    expected_answer: str, generated_answer: str, timeout_seconds: int = 5
) -> tuple[float, str | None, tuple[str, str] | None]:
    """(1.0 or 0.0, the extracted answer or None, a note or None). Runs in a verify-pool worker (main
    thread: each parse and comparison is bounded in CPU time by :func:`cpu_time_bound`).

    An ``expected_answer`` math-verify cannot parse raises ValueError (bad data is not a wrong answer:
    ``/verify`` answers 422 "bad row"); one it runs out of time parsing is noted ``EXPECTED_TIMEOUT``
    (the row's cost, not the model's: a 503). What it cannot read in the model's text is no answer; an
    error while comparing is no match. A parse or comparison of the model's answer that outlives
    ``timeout_seconds`` is noted ``ANSWER_TIMEOUT`` with 0.0: an answer that cannot be checked within the
    bound is not shown equal (a normal answer takes milliseconds; a tower of powers or a 20,000-term sum
    is the model's doing). A box stating an equality of two numbers that is false (``360 = 720``, whose
    right side math-verify would compare) is noted ``FALSE_EQUATION`` with 0.0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    quiet = (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()))
    with quiet[0], quiet[1]:
        try:
            with cpu_time_bound(timeout_seconds):
                gold = parse(
                    "\\boxed{" + strip_math_delimiters(expected_answer) + "}",
                    extraction_config=[LatexExtractionConfig()],
                    parsing_timeout=None,  # bounded in CPU time around it
                    raise_on_error=True,
                )
        except TimeoutException as e:  # a BaseException: turn it into a note the caller reports
            return (
                0.0,
                None,
                (
                    EXPECTED_TIMEOUT,
                    f"math-verify timed out parsing expected_answer {expected_answer!r:.200}: {e}",
                ),
            )
        if not gold:
            raise ValueError(f"{_BAD_EXPECTED} {expected_answer!r}")
        try:
            with cpu_time_bound(timeout_seconds):
                pred = parse(
                    generated_answer,
                    extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                    parsing_timeout=None,
                    raise_on_error=True,
                )
        except TimeoutException:
            return (
                0.0,
                None,
                (ANSWER_TIMEOUT, f"math-verify ran out of time ({timeout_seconds} s) parsing the answer"),
            )
        except Exception:  # text math-verify cannot turn into math: no answer
            pred = []
        extracted = str(pred[-1]) if pred else None
        if pred and (false := _false_equation(pred[0], timeout_seconds)) is not None:
            if false == "":
                return (
                    0.0,
                    extracted,
                    (
                        ANSWER_TIMEOUT,
                        f"math-verify ran out of time ({timeout_seconds} s) on the answer's equation",
                    ),
                )
            return 0.0, extracted, (FALSE_EQUATION, f"the answer states a false equation: {false}")
        try:
            with cpu_time_bound(timeout_seconds):
                ok = bool(pred) and verify(gold, pred, timeout_seconds=None, raise_on_error=True)
        except TimeoutException:
            return (
                0.0,
                extracted,
                (
                    ANSWER_TIMEOUT,
                    f"math-verify ran out of time ({timeout_seconds} s) comparing {extracted!s:.200} with the expected answer",
                ),
            )
        except Exception:  # sympy could not compare them: not shown equal
            ok = False
    return (1.0 if ok else 0.0), extracted, None


def _numbers_equal(lhs: Any, rhs: Any) -> bool:
    """Whether two symbol-free sympy expressions are equal numbers (to 1e-9, relative), evaluated to 30
    digits in sympy's own floats (no overflow); an infinity, a NaN or what does not evaluate to a number
    is not equal."""
    import sympy

    try:
        left, right = sympy.N(lhs, 30), sympy.N(rhs, 30)
        diff = sympy.N(left - right, 30)
        if not (left.is_number and right.is_number and diff.is_number) or not diff.is_finite:
            return False
        scale = sympy.Max(1, sympy.Abs(left), sympy.Abs(right))
        return bool(sympy.Abs(diff) <= sympy.Float("1e-9") * scale)
    except (TypeError, ValueError, ArithmeticError, AttributeError):
        return False


def _false_equation(expr: Any, timeout_seconds: int) -> str | None:
    """The first equality in ``expr`` between two numbers (no free symbols) that is false, as text; ""
    when checking ran past ``timeout_seconds``; None when there is none. ``x = 720`` and ``6 \\times 120 =
    720`` are fine; ``360 = 720`` is false (math-verify compares an equation's right side alone)."""

    import sympy

    equations = list(expr.atoms(sympy.Equality)) if isinstance(expr, sympy.Basic) else []
    if isinstance(expr, sympy.Equality):
        equations.append(expr)
    if not equations:
        return None

    from math_verify.errors import TimeoutException

    try:
        with cpu_time_bound(timeout_seconds):
            for eq in equations:
                lhs, rhs = eq.lhs, eq.rhs
                if not isinstance(lhs, sympy.Expr) or not isinstance(rhs, sympy.Expr):
                    continue
                if lhs.free_symbols or rhs.free_symbols:
                    continue
                if not _numbers_equal(lhs, rhs):
                    return f"{lhs} = {rhs}"[:200]
        return None
    except TimeoutException:
        return ""


@contextlib.contextmanager
def cpu_time_bound(seconds: float) -> Iterator[None]:
    """Raise math-verify's TimeoutException once the code inside has used ``seconds`` of this process's CPU
    time (``ITIMER_PROF``). math-verify's own bound is ``signal.alarm``, wall-clock time, which a busy
    machine uses up on a cheap parse: the row or the answer would be blamed for the machine's load. CPU
    time is what the answer costs. (A check past ``library_verifier_timeout_seconds`` of wall time is
    still killed with its worker.) Main thread of a pool worker only, as math-verify's alarm."""
    import signal

    from math_verify.errors import TimeoutException

    def out_of_time(signum: int, frame: Any) -> None:
        raise TimeoutException(f"more than {seconds:g} s of CPU time")

    previous = signal.signal(signal.SIGPROF, out_of_time)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def warm_up_worker() -> float:
    """Import math-verify (sympy, the LaTeX grammar) in a pool worker before the first real answer."""
    return math_verify_answer("1", "\\boxed{1}")[0]


@dataclass
class _VerifyNotes:
    """What one verify learned besides upstream's 4-tuple (the hooks below keep upstream's signatures)."""

    library_verify_timed_out: bool = False
    judge_verdict_unparseable: bool = False
    # Why a 0, when a check knows better than "wrong answer"; `final`: no judge may overturn it.
    failure_reason: str | None = None
    final: bool = False


_NOTES: contextvars.ContextVar[_VerifyNotes | None] = contextvars.ContextVar(
    "math_with_judge_notes", default=None
)


def _note(**flags: Any) -> None:
    notes = _NOTES.get()
    if notes is not None:
        for name, value in flags.items():
            setattr(notes, name, value)


_BOX_COMMANDS = ("boxed", "fbox")


def boxed_answers(text: str) -> list[str]:
    """What every closed ``\\boxed{...}`` / ``\\fbox{...}`` says itself (:func:`nemo_gym.kit.text.boxed_answers`)."""
    return _text.boxed_answers(text, _BOX_COMMANDS)


def unclosed_boxes(text: str) -> int:
    """How many ``\\boxed{`` / ``\\fbox{`` of ``text`` never close (braces counted)."""
    return _text.unclosed_boxes(text, _BOX_COMMANDS)


def several_answers(text: str) -> str | None:
    """Why ``text`` is a hedge when it boxes several different answers (None when it does not)."""
    boxes = list(dict.fromkeys(b for b in (" ".join(x.split()) for x in boxed_answers(text)) if b))
    if len(boxes) < 2:
        return None
    shown = ", ".join(f"\\boxed{{{b[:40]}}}" for b in boxes[:4]) + (", ..." if len(boxes) > 4 else "")
    return f"several different answers ({shown}): an answer must give one"


def tail(text: str, limit: int) -> str:
    """``text``, or its last ``limit`` characters after a note that the rest was cut."""
    return (
        text
        if len(text) <= limit
        else f"[... {len(text) - limit:,} earlier characters cut ...]\n" + text[-limit:]
    )


class LibraryJudgeMathResourcesServer(SimpleResourcesServer):
    """The verify is split into upstream's hooks, with upstream's names, arguments and results, so an
    environment built on upstream's math_with_judge (physics_judge, math_with_autograder,
    ugphysics_judge) overrides them here unchanged:

    ``verify`` -> ``_verify_answer(question, expected, generated)`` -> (reward, extracted,
    library_reward, judge_evaluations) -> ``_verify_answer_with_library_async(expected, generated)``
    -> (library_reward, extracted), then, when the judge is used,
    ``_verify_answer_with_judge(question, expected, answer)`` -> (reward, evaluations), which asks
    ``_generate_judge_evaluation(question, first, second)`` -> (equal, evaluation) in both orders.
    The prompt and labels are the class's ``JUDGE_*`` constants unless the config sets them.
    """

    JUDGE_SYSTEM_MESSAGE: ClassVar[str] = JUDGE_SYSTEM_MESSAGE
    JUDGE_PROMPT_TEMPLATE: ClassVar[str] = JUDGE_PROMPT_TEMPLATE
    JUDGE_EQUAL_LABEL: ClassVar[str] = "[[A=B]]"
    JUDGE_NOT_EQUAL_LABEL: ClassVar[str] = "[[A!=B]]"

    config: LibraryJudgeMathResourcesServerConfig

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self._library_verifier_semaphore = asyncio.Semaphore(self.config.library_verifier_max_concurrency)

    async def on_startup(self) -> None:
        await super().on_startup()
        # A cold worker spends seconds importing sympy; warm every worker now, in the background, so
        # the first answers' library_verifier_timeout_seconds measures verification, not imports.
        get_verify_pool().warm_up(warm_up_worker, timeout=300)

    @judge_failsafe
    async def verify(self, body: LibraryJudgeMathVerifyRequest) -> LibraryJudgeMathVerifyResponse:
        text = "".join(
            part.text
            for item in body.response.output
            if item.type == "message"
            for part in item.content
            if part.type == "output_text"
        )
        notes = _VerifyNotes()
        if unclosed_boxes(text):  # which box holds the answer cannot be told: nothing is run
            reward, extracted, library_reward, evaluations = 0.0, None, 0.0, None
            notes.failure_reason = (
                "no answer: a \\boxed{ is left open, so the answer's boxes cannot be told apart"
            )
        else:
            token = _NOTES.set(notes)
            try:
                reward, extracted, library_reward, evaluations = await self._verify_answer(
                    body.question, body.expected_answer, text
                )
            finally:
                _NOTES.reset(token)
        reason = None
        if reward <= 0:
            reason = notes.failure_reason
            if evaluations:
                reason = "the judge found the answer different from the expected one"
                if notes.judge_verdict_unparseable:
                    reason = "the judge's reply had no verdict label (unparseable_verdict: metric)"
                if notes.library_verify_timed_out:
                    reason += " (math-verify ran out of time on it)"
            elif reason is None:
                reason = several_answers(text) or (
                    f"wrong answer: math-verify read {extracted!r:.200}, not equal to the expected answer"
                    if extracted is not None
                    else "no answer: math-verify read no expression in the answer"
                )
        return LibraryJudgeMathVerifyResponse.from_request(
            body,
            reward=reward,
            extracted_answer=extracted,
            library_reward=library_reward,
            judge_evaluations=evaluations,
            judge_verdict_unparseable=notes.judge_verdict_unparseable,
            library_verify_timed_out=notes.library_verify_timed_out,
            failure_reason=reason,
        )

    async def _verify_answer(
        self, question: str, expected_answer: str, generated_answer: str
    ) -> tuple[float, str | None, float, list[JudgeEvaluation] | None]:
        """(reward, extracted answer, math-verify's reward, judge evaluations or None)."""
        library_reward, extracted = await self._verify_answer_with_library_async(
            expected_answer, generated_answer
        )
        if not self.config.should_use_judge or library_reward > 0.5:
            return library_reward, extracted, library_reward, None
        notes = _NOTES.get()
        refusal = None if notes is None or not notes.final else notes.failure_reason
        refusal = refusal or self._judge_refusal(generated_answer)
        if refusal is not None:
            _note(failure_reason=refusal, final=True)
            return library_reward, extracted, library_reward, None
        judged = extracted or tail(generated_answer, self.config.judge_max_answer_chars)
        judge_reward, evaluations = await self._verify_answer_with_judge(question, expected_answer, judged)
        return judge_reward, extracted, library_reward, evaluations

    def _judge_refusal(self, text: str) -> str | None:
        """Why an answer math-verify did not accept goes to no judge: it boxes several different answers
        (a hedge, whichever of them the judge would read), or it carries a verdict label of the judge
        (an answer that writes the grader's verdict is an injection, not math)."""
        if not text.strip():
            return "no answer: the response has no text"
        if (several := several_answers(text)) is not None:
            return several
        labels = [
            self.config.judge_equal_label or self.JUDGE_EQUAL_LABEL,
            self.config.judge_not_equal_label or self.JUDGE_NOT_EQUAL_LABEL,
        ]
        for label in labels:
            if label in text:
                return f"the answer contains the judge's verdict label {label}: it is not sent to the judge"
        return None

    @staticmethod
    def _strip_math_delimiters(s: str) -> str:
        return strip_math_delimiters(s)

    async def _verify_answer_with_library_async(
        self, expected_answer: str, generated_answer: str
    ) -> tuple[float, str | None]:
        """math-verify's (1.0 or 0.0, extracted answer), in the verify pool.

        An answer math-verify runs out of time on (its own bound on a parse or comparison, or the whole
        check killed past ``library_verifier_timeout_seconds`` twice) is (0.0, None) with
        ``library_verify_timed_out``: with a judge the judge decides, as upstream; without one it is a
        0 with its reason (upstream: 0.0 too). A false equation in the answer's box is (0.0, extracted),
        final. Only the row's ``expected_answer`` running out of time is a 503 (``verify_timeout``)."""
        try:
            async with self._library_verifier_semaphore:
                reward, extracted, note = await self._library_check(expected_answer, generated_answer)
        except ValueError as e:  # the row's expected_answer (math_verify_check): bad data, not a 0 or a 500
            if _BAD_EXPECTED not in str(e):
                raise
            raise HTTPException(422, f"bad row: {e}") from None
        if note is None:
            return reward, extracted
        kind, detail = note
        if kind == EXPECTED_TIMEOUT:
            raise VerifyTimeoutError(detail)  # HTTP 503 verify_timeout: the row's cost, not scored
        if kind == FALSE_EQUATION:
            _note(failure_reason=detail, final=True)
            return 0.0, extracted
        _note(
            library_verify_timed_out=True,
            failure_reason=f"{detail}: an answer that cannot be checked within the bound is not shown equal",
        )
        return 0.0, None

    async def _library_check(
        self, expected_answer: str, generated_answer: str
    ) -> tuple[float, str | None, tuple[str, str] | None]:
        """:func:`math_verify_check` in the pool. A check killed past ``library_verifier_timeout_seconds``
        (math-verify's alarm cannot stop C code, e.g. a huge power) or whose worker dies is tried once
        more on a fresh worker; twice is the answer's doing (a noted ``ANSWER_TIMEOUT``), never a 503."""
        bound = self.config.library_verifier_timeout_seconds
        failure = ""
        for _ in range(2):
            try:
                return await run_in_verify_pool(
                    math_verify_check,
                    expected_answer,
                    generated_answer,
                    self.config.math_verify_timeout_seconds,
                    timeout=bound,
                )
            except VerifyTimeoutError:
                failure = f"math-verify did not finish within {bound:g} s on the answer (twice; its worker was killed)"
            except VerifyWorkerCrashedError:
                failure = "math-verify's worker died on the answer (twice)"
        return 0.0, None, (ANSWER_TIMEOUT, failure)

    async def _verify_answer_with_judge(
        self, question: str, expected_answer: str, generated_answer: str
    ) -> tuple[float, list[JudgeEvaluation]]:
        """Both orders (to cancel position bias); 1.0 only if both say equal (no second ask after a 'different')."""
        equal, first = await self._generate_judge_evaluation(question, expected_answer, generated_answer)
        if not equal:
            return 0.0, [first]
        equal, second = await self._generate_judge_evaluation(question, generated_answer, expected_answer)
        return (1.0 if equal else 0.0), [first, second]

    async def _generate_judge_evaluation(
        self, question: str, first_answer: str, second_answer: str
    ) -> tuple[bool, JudgeEvaluation]:
        """One judge verdict: (the answers are equal, the request and reply). A reply without a label is
        a JudgeError (``unparseable_verdict: error``) or not equal, noted (``metric``)."""
        cfg = self.config
        assert cfg.judge_model_server is not None
        equal_label = cfg.judge_equal_label or self.JUDGE_EQUAL_LABEL
        not_equal_label = cfg.judge_not_equal_label or self.JUDGE_NOT_EQUAL_LABEL
        params = cfg.judge_responses_create_params.model_copy(deep=True)
        prompt = (cfg.judge_prompt_template or self.JUDGE_PROMPT_TEMPLATE).format(
            question=question, first_answer=first_answer, second_answer=second_answer
        )
        params.input = [
            NeMoGymEasyInputMessage(
                role="system", content=cfg.judge_system_message or self.JUDGE_SYSTEM_MESSAGE
            ),
            NeMoGymEasyInputMessage(role="user", content=prompt),
        ]
        response = await call_judge(
            self.server_client,
            server_name=cfg.judge_model_server.name,
            url_path="/v1/responses",
            json=params.model_dump(exclude_unset=True, mode="json"),
            response_model=NeMoGymResponse,
        )
        evaluation = JudgeEvaluation(responses_create_params=params, response=response)
        verdict_text = response.output_text
        eq, ne = verdict_text.find(equal_label), verdict_text.find(not_equal_label)
        if eq >= 0 or ne >= 0:  # the first label in the text wins
            return (eq >= 0 and (ne < 0 or eq < ne)), evaluation
        if cfg.unparseable_verdict == "error":
            raise JudgeError(
                f"judge {cfg.judge_model_server.name!r} gave no verdict label "
                f"({equal_label} or {not_equal_label}): {verdict_text[:300]!r}",
                server=cfg.judge_model_server.name,
                path="/v1/responses",
            )
        _note(judge_verdict_unparseable=True)
        return False, evaluation

    @staticmethod
    def _math_score_fn(r: dict[str, Any]) -> dict[str, float]:
        scores = {"accuracy": r["reward"]}
        if "library_reward" in r:
            scores["symbolic_accuracy"] = r["library_reward"]
        if r.get("judge_evaluations") is not None:
            scores["judge_accuracy"] = r["reward"]
            scores["judge_verdict_unparseable"] = float(bool(r.get("judge_verdict_unparseable")))
            scores["library_verify_timed_out"] = float(bool(r.get("library_verify_timed_out")))
        return scores

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return compute_pass_majority_metrics(
            tasks, score_fn=self._math_score_fn, answer_key="extracted_answer"
        )[0]

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        """Upstream's headline selection (token means, pass@1[avg-of-k], pass@k and majority@k at the
        largest k, no_answer only in the first) plus ``mean/reward``."""
        names = ("mean/reward", "mean/input_tokens", "mean/output_tokens")
        key = {k: agent_metrics[k] for k in names if k in agent_metrics}
        key |= highest_k_metrics(agent_metrics, "pass@1[avg-of-{k}]")
        key |= highest_k_metrics(agent_metrics, "pass@{k}", exclude_names=["no_answer"])
        key |= highest_k_metrics(agent_metrics, "majority@{k}", exclude_names=["no_answer"])
        return key


if __name__ == "__main__":
    LibraryJudgeMathResourcesServer.run_webserver()
