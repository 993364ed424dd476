"""What an environment server's ``/run`` takes and returns: one episode, identified, with a result or a failure.

Contract
--------
* Names and fields are NeMo Gym 0.7's ``nemo_gym.episode_types`` (our face at that path imports them from
  here), so an environment server written for it runs unchanged.
* :class:`EpisodeId` is one attempt of one rollout: ``rollout_id`` (letters, digits, ``.``, ``_``, ``-``;
  never ending in ``-a<N>``, which :attr:`EpisodeId.capture_key` adds for attempts after the first).
* :class:`TaskId` names a task inside a taskset; :class:`MaterializedTask` carries it with the task's
  input, typed by the environment.
* A :class:`BaseEpisodeResponse` holds exactly one of ``result`` and ``failure``. A failure is an
  :class:`EpisodeFailure`: why (at most 2,000 characters), whether another attempt may help (``terminal``),
  and optionally a kind from :data:`FAILURE_KINDS` (or an environment's own ``<server>:<kind>``) and the
  :data:`FailureStage` it happened in (an unknown kind is kept and logged once). A failure is never a reward: the collector writes it to the
  failures file, not to the rollouts.
* Every model here refuses unknown fields.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]

# The shared failure vocabulary (upstream 0.7's names): what kind of thing went wrong, nothing more.
FAILURE_KINDS: frozenset[str] = frozenset(
    {
        "transport_unreachable",
        "transport_peer_drop",
        "transport_timeout",
        "transport_local_resource",
        "agent_run_error",
        "agent_request_failed",
        "agent_timeout",
        "agent_command_not_allowed",
        "judge_failed",
        "judge_unparseable",
        "verifier_error",
        "provider_unavailable",
        "provider_quota_exhausted",
        "provider_oom_killed",
        "session_lost",
        "session_expired",
        "session_release_failed",
        "cancelled",
        "kill_shaped",
        "shutdown",
        "persistence_failed",
        "cohort_incomplete",
    }
)
_NAMESPACED_KIND = re.compile(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*")
_ATTEMPT_SUFFIX = re.compile(r"-a[1-9][0-9]*$")
_WARNED_KINDS: set[str] = set()
LOG = logging.getLogger(__name__)


def is_known_failure_kind(kind: str) -> bool:
    """Whether ``kind`` is in the shared vocabulary or an environment's own ``<server>:<kind>``."""
    return kind in FAILURE_KINDS or bool(_NAMESPACED_KIND.fullmatch(kind))


def validate_failure_kind(kind: str | None) -> str | None:
    """``kind`` as given, with one warning per kind outside the vocabulary: refusing it would turn a
    reported failure into a lost one."""
    if kind is not None and not is_known_failure_kind(kind) and kind not in _WARNED_KINDS:
        _WARNED_KINDS.add(kind)
        LOG.warning("failure_kind %r is neither a shared kind nor '<server>:<kind>'", kind)
    return kind


class EpisodeId(BaseModel):
    """One attempt (``attempt``, from 0) of one rollout (``rollout_id``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def _no_attempt_suffix(cls, rollout_id: str) -> str:
        if _ATTEMPT_SUFFIX.search(rollout_id):
            raise ValueError("rollout_id must not end in '-a<N>': that suffix marks an attempt (capture_key)")
        return rollout_id

    @property
    def capture_key(self) -> str:
        """The rollout id of this attempt: ``rollout_id`` for the first, ``<rollout_id>-a<N>`` after."""
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"


class TaskId(BaseModel):
    """A task of a taskset (``<environment>:<taskset>`` when a run blends several environments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


def is_materialized_task_row(row: Mapping[str, Any]) -> bool:
    """Whether a task row is an episode's task (``task_id`` a mapping, and ``task_input``) rather than a
    flat row for an agent's ``/run``. Says how the row routes, not whether it is valid."""
    return isinstance(row.get("task_id"), Mapping) and "task_input" in row


class EpisodeFailure(BaseModel):
    """Why an episode produced no result; the same fields on the wire and in the failures file."""

    model_config = ConfigDict(extra="forbid")

    failure_reason: str = Field(max_length=2000)
    terminal: bool  # True: another attempt of this episode cannot help
    failure_kind: str | None = None
    stage: FailureStage | None = None

    @field_validator("failure_kind")
    @classmethod
    def _kind_is_known(cls, kind: str | None) -> str | None:
        return validate_failure_kind(kind)

    @model_serializer(mode="wrap")
    def _leave_out_unset_labels(self, handler: Any) -> Any:
        data = handler(self)
        for key in ("failure_kind", "stage"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


TaskInputT = TypeVar("TaskInputT", bound=BaseModel)
EpisodeResultT = TypeVar("EpisodeResultT")


class MaterializedTask(BaseModel, Generic[TaskInputT]):
    """A task's identity and its input, in the shape its environment's protocol takes."""

    model_config = ConfigDict(extra="forbid")

    task_id: TaskId
    task_input: TaskInputT


class BaseEpisodeRequest(BaseModel, Generic[TaskInputT]):
    """The body of an environment server's ``/run``: which attempt, and the task."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task: MaterializedTask[TaskInputT]


class BaseEpisodeResponse(BaseModel, Generic[EpisodeResultT]):
    """The answer of an environment server's ``/run``: the request's identity and a result or a failure."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task_id: TaskId
    result: EpisodeResultT | None = None
    failure: EpisodeFailure | None = None

    @model_validator(mode="after")
    def _result_or_failure(self) -> BaseEpisodeResponse[EpisodeResultT]:
        if (self.result is None) == (self.failure is None):
            raise ValueError("an episode response holds exactly one of result and failure")
        return self
