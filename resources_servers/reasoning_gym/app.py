"""reasoning_gym: 100+ procedural reasoning tasks from the ``reasoning-gym`` package, scored by each
task's own ``score_answer``.

Contract
--------
* A row carries ``question``, ``answer`` (the reference, may be null for tasks that check answers
  themselves) and ``metadata`` with ``source_dataset`` (the task name) and whatever the task's scorer
  reads, exactly as ``reasoning_gym`` generates them (upstream NeMo Gym's field names). Rows are
  generated offline by ``scripts/create_dataset.py`` (task names, seed, size).
* The model's answer is read from the assistant text: the last ``<answer>...</answer>``; failing that
  the content of the first non-empty ``\\boxed{...}``, its nested braces balanced (``\\boxed{\\frac{1}{2}}``
  is ``\\frac{1}{2}``; upstream's regex cuts it at the first ``}``, ``\\frac{1``); failing that the
  whole text (as upstream).
* ``score`` = ``reasoning_gym.get_score_answer_fn(task)(answer, entry)`` (0.0 .. 1.0, the task's own
  number). ``reward`` = 1.0 for a full score, else 0.0: many of the package's scorers pay wrong answers
  (containment ratios, 0.01 / 0.05 format credit, 0.5 for an unfactored product), so partial credit is
  not a reward unless ``partial_credit: true`` (then ``reward`` = ``score``, upstream's way).
* One answer: ``<answer>`` blocks (or, without one, boxes) giving different answers, or markup left
  open (an ``<answer>`` inside a block, a ``\\boxed{`` never closed), are 0 without a score. The scorer runs in :mod:`nemo_gym.kit.verify_pool` (:func:`score_in_worker`), stopped by an
  alarm past ``score_timeout_seconds`` (the pool kills it past that plus :data:`IMPORT_ALLOWANCE_SECONDS`;
  such a check is tried once more on a fresh worker).
* What the answer makes the scorer do is the answer's score, with ``failure_reason``: a scorer that
  raises, runs past its bound (twice, for the pool's), dies, or returns something that is not a number
  from 0 to 1 is 0 (upstream: a raising scorer is 0.0, a hang is never scored). An unknown task is the
  row's fault: HTTP 422 "bad row"; a row without ``question``, ``answer`` or ``metadata`` is refused by
  ``ng_collect_rollouts`` before any rollout.
* The pool's workers import ``reasoning_gym`` in the background when the server starts.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, PositiveFloat

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.process_cache import ProcessCache
from nemo_gym.kit.text import all_boxed, boxed_answers, unclosed_boxes
from nemo_gym.kit.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    get_verify_pool,
    run_in_verify_pool,
)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A score this close to 1 is full credit (a task's float arithmetic).
FULL_SCORE_TOLERANCE = 1e-9
# Added to score_timeout_seconds for the pool's bound: a fresh worker imports reasoning_gym first.
IMPORT_ALLOWANCE_SECONDS = 60.0


class ReasoningGymResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    # Bound on one score_answer call of the task's scorer on the model's answer.
    score_timeout_seconds: PositiveFloat = 60.0
    # false: reward 1.0 only for the task's full score (score stays the task's own number); true:
    # reward = score, upstream's way, which pays wrong answers (format credit, containment ratios).
    partial_credit: bool = False


class ReasoningGymMetadata(BaseModel):
    """The generator's metadata: ``source_dataset`` is required, the rest is the task's own."""

    model_config = ConfigDict(extra="allow")

    source_dataset: str


class ReasoningGymVerifyRequest(BaseVerifyRequest):
    question: str
    answer: str | None
    metadata: ReasoningGymMetadata


class ReasoningGymVerifyResponse(BaseVerifyResponse):
    task_name: str
    score: float
    extracted_answer: str | None
    # Why the reward is 0 (None when it is not).
    failure_reason: str | None = None


def extract_model_answer(text: str) -> str:
    """The last ``<answer>`` block, else the first ``\\boxed{}`` (braces balanced), else the stripped text."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    boxed = first_boxed(text)
    if boxed is not None:
        return boxed
    return text.strip()


def unreadable_markup(text: str) -> str | None:
    """Why the answer's markup cannot be read (None when it can): an ``<answer>`` opened inside another
    block (a block left open before the one that closes), or, without a block, a ``\\boxed{`` left
    open. A megabyte of unclosed openers before the right answer is not that answer."""
    tagged = _ANSWER_TAG.findall(text)
    if any("<answer>" in t for t in tagged):
        return "no answer: an <answer> tag is left open, so the answer's blocks cannot be told apart"
    if not tagged and unclosed_boxes(text):
        return "no answer: a \\boxed{ is left open, so the answer's boxes cannot be told apart"
    return None


def several_answers(text: str) -> str | None:
    """Why ``text`` gives several different answers (None when it gives one): ``<answer>`` blocks that
    differ, or, without one, boxes that differ (a box nested in another counts on its own)."""
    tagged = [t.strip() for t in _ANSWER_TAG.findall(text)]
    if tagged:
        found = list(dict.fromkeys(t for t in tagged if t))  # an empty block says nothing
        where = "<answer> blocks"
    else:
        found = list(dict.fromkeys(b for b in (" ".join(x.split()) for x in boxed_answers(text)) if b))
        where = "boxes"
    if len(found) < 2:
        return None
    shown = ", ".join(repr(a[:40]) for a in found[:4]) + (", ..." if len(found) > 4 else "")
    return f"several different answers in {where} ({shown}): an answer must give one"


def first_boxed(text: str) -> str | None:
    """The stripped content of the first ``\\boxed{...}`` that closes and is not empty (nested braces
    balanced), or None. One pass over ``text`` (a long answer of unclosed boxes costs its length)."""
    return next((b.strip() for b in all_boxed(text) if b.strip()), None)


def _make_score_fn(task: str) -> Callable[..., Any]:
    """``reasoning_gym.get_score_answer_fn(task)``, made once per task and worker process.

    It builds the task's dataset object (``LetterCountingDataset`` reads and splits a word list, ...):
    ~40% of a pool worker's time when it ran for every score (py-spy, the example rows at 64 in flight).
    None of reasoning_gym's 75 ``score_answer`` definitions assigns to its dataset object or reads a
    ``self.rng`` (checked with ``ast`` on the installed package), so one object serves every score.
    An unknown task raises each time (not cached).
    """
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


# Per worker process; a Ray task takes an empty one along (nemo_gym.kit.process_cache).
_score_fn = ProcessCache(_make_score_fn, maxsize=256)


def score_answer(task: str, answer: str, entry: dict[str, Any]) -> float:
    """The task's own score of ``answer`` (runs in a verify-pool worker)."""
    return float(_score_fn(task)(answer=answer, entry=entry))


class _OutOfTime(BaseException):
    """Raised into a scorer past its bound: a BaseException, so a scorer's ``except Exception`` cannot
    turn it into a score."""


def score_in_worker(task: str, answer: str, entry: dict[str, Any], budget: float) -> tuple[str, float, str]:
    """``(outcome, score, detail)`` of the task's scorer on ``answer``, in a verify-pool worker:
    ``ok`` (the score), ``unknown_task`` (the row's fault), ``raised`` (the scorer failed on this
    answer), ``timeout`` (it ran past ``budget`` seconds, measured from when the scorer is built, so a
    fresh worker's imports do not count), ``bad_score`` (not a number from 0 to 1)."""
    try:
        scorer = _score_fn(task)
    except Exception as e:  # reasoning_gym does not know the task
        return "unknown_task", 0.0, f"{type(e).__name__}: {e}"[:300]
    fired = False

    def out_of_time(signum: int, frame: Any) -> None:
        nonlocal fired
        fired = True
        raise _OutOfTime

    alarm = threading.current_thread() is threading.main_thread()  # a Ray worker's thread may not be
    if alarm:
        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        score = scorer(answer=answer, entry=entry)
    except _OutOfTime:
        fired = True
    except Exception as e:  # the scorer could not score this answer: the answer's doing
        return "raised", 0.0, f"{type(e).__name__}: {e}"[:300]
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    if fired:  # also when a scorer's bare ``except:`` swallowed the alarm
        return "timeout", 0.0, f"the task's scorer ran past {budget:g} s on the answer"
    try:
        value = float(score)
    except (TypeError, ValueError, OverflowError):
        return "bad_score", 0.0, f"the task's scorer returned {score!r:.100}"
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return "bad_score", 0.0, f"the task's scorer returned {value!r}"
    return "ok", value, ""


def import_reasoning_gym() -> int:
    """Import the package in a worker ahead of the first score (it takes seconds); the number of tasks."""
    import reasoning_gym.factory

    return len(reasoning_gym.factory.DATASETS)


class ReasoningGymResourcesServer(SimpleResourcesServer):
    config: ReasoningGymResourcesServerConfig

    async def on_startup(self) -> None:
        await super().on_startup()
        # Warm every pool worker in the background (reasoning_gym imports matplotlib, sympy, ...).
        get_verify_pool().warm_up(import_reasoning_gym, timeout=self.config.score_timeout_seconds * 5)

    async def verify(self, body: ReasoningGymVerifyRequest) -> ReasoningGymVerifyResponse:
        task = body.metadata.source_dataset
        text = body.response.output_text
        answer = extract_model_answer(text)
        entry = {"question": body.question, "answer": body.answer, "metadata": body.metadata.model_dump()}
        reason = unreadable_markup(text) or several_answers(text)
        score = 0.0
        if reason is None:
            outcome, score, detail = await self._score(task, answer, entry)
            if outcome == "unknown_task":
                raise HTTPException(422, f"bad row: metadata.source_dataset {task!r}: {detail}")
            if outcome != "ok":
                reason = {
                    "raised": f"the task's scorer failed on the answer ({detail})",
                    "timeout": detail,
                    "bad_score": detail,
                }[outcome]
        full = score >= 1.0 - FULL_SCORE_TOLERANCE
        reward = score if self.config.partial_credit else (1.0 if full else 0.0)
        if reason is None and reward <= 0:
            reason = (
                "wrong answer: the task's score is 0"
                if score <= 0
                else f"wrong answer: the task's score is {score:g}, not full (partial_credit: false)"
            )
        fields = body.model_dump(
            exclude={"reward", "task_name", "score", "extracted_answer", "failure_reason"}
        )
        return ReasoningGymVerifyResponse(
            **fields,
            reward=reward,
            task_name=task,
            score=score,
            extracted_answer=answer,
            failure_reason=reason if reward <= 0 else None,
        )

    async def _score(self, task: str, answer: str, entry: dict[str, Any]) -> tuple[str, float, str]:
        """:func:`score_in_worker` in the pool. Its own alarm bounds the scorer; the pool's bound (the
        alarm's plus :data:`IMPORT_ALLOWANCE_SECONDS` for a fresh worker's imports) catches a scorer stuck
        where the alarm cannot reach it (C code). A check killed there, or whose worker dies, is tried
        once more on a fresh worker; twice is the answer's doing (a 0), never a 503."""
        budget = self.config.score_timeout_seconds
        detail = ""
        for _ in range(2):
            try:
                return await run_in_verify_pool(
                    score_in_worker, task, answer, entry, budget, timeout=budget + IMPORT_ALLOWANCE_SECONDS
                )
            except VerifyTimeoutError:
                detail = f"the task's scorer did not finish on the answer (twice; its worker was killed past {budget + IMPORT_ALLOWANCE_SECONDS:g} s)"
            except VerifyWorkerCrashedError:
                detail = "the task's scorer's worker died on the answer (twice)"
        return "timeout", 0.0, detail

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Mean reward per reasoning-gym task (``mean/reward_<task>``)."""
        by_task: dict[str, list[float]] = {}
        for rollouts in tasks:
            for r in rollouts:
                by_task.setdefault(str(r.get("task_name")), []).append(float(r.get("reward", 0.0)))
        return {f"mean/reward_{t}": sum(v) / len(v) for t, v in sorted(by_task.items())}


if __name__ == "__main__":
    ReasoningGymResourcesServer.run_webserver()
