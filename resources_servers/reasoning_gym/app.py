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
* ``reward`` = ``score`` = ``reasoning_gym.get_score_answer_fn(task)(answer, entry)`` (0.0 .. 1.0;
  partial credit where the task gives it). The scorer runs in :mod:`nemo_gym.kit.verify_pool` (some tasks
  use sympy or search), with ``score_timeout_seconds``.
* A scorer that raises or an unknown task is an error (HTTP 500 naming it), never a 0 (upstream
  scores a raising scorer 0.0); a row without ``question``, ``answer`` or ``metadata`` is refused by
  ``ng_collect_rollouts`` before any rollout (``metadata.source_dataset`` is checked at ``/verify``).
* The pool's workers import ``reasoning_gym`` in the background when the server starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PositiveFloat

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.process_cache import ProcessCache
from nemo_gym.kit.verify_pool import get_verify_pool, run_in_verify_pool

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_OPEN = "\\boxed{"


class ReasoningGymResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    score_timeout_seconds: PositiveFloat = 60.0


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


def extract_model_answer(text: str) -> str:
    """The last ``<answer>`` block, else the first ``\\boxed{}`` (braces balanced), else the stripped text."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    boxed = first_boxed(text)
    if boxed is not None:
        return boxed
    return text.strip()


def first_boxed(text: str) -> str | None:
    """The stripped content of the first ``\\boxed{...}`` that closes and is not empty (nested braces
    balanced), or None."""
    start = text.find(_BOXED_OPEN)
    while start >= 0:
        begin = i = start + len(_BOXED_OPEN)
        depth = 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        content = text[begin : i - 1].strip() if depth == 0 else ""
        if content:
            return content
        start = text.find(_BOXED_OPEN, begin)
    return None


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
        answer = extract_model_answer(body.response.output_text)
        entry = {"question": body.question, "answer": body.answer, "metadata": body.metadata.model_dump()}
        score = await run_in_verify_pool(
            score_answer, task, answer, entry, timeout=self.config.score_timeout_seconds
        )
        fields = body.model_dump(exclude={"reward", "task_name", "score", "extracted_answer"})
        return ReasoningGymVerifyResponse(
            **fields, reward=score, task_name=task, score=score, extracted_answer=answer
        )

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Mean reward per reasoning-gym task (``mean/reward_<task>``)."""
        by_task: dict[str, list[float]] = {}
        for rollouts in tasks:
            for r in rollouts:
                by_task.setdefault(str(r.get("task_name")), []).append(float(r.get("reward", 0.0)))
        return {f"mean/reward_{t}": sum(v) / len(v) for t, v in sorted(by_task.items())}


if __name__ == "__main__":
    ReasoningGymResourcesServer.run_webserver()
