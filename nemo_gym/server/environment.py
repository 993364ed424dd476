"""Environment servers: one server that owns a whole episode (NeMo Gym 0.7's fourth kind of server).

Contract
--------
* Names and config keys are NeMo Gym 0.7's ``nemo_gym.base_environment_server`` (our face at that path
  imports them from here). A subclass sets ``request_model``/``response_model`` (a
  :class:`~nemo_gym.server.episodes.BaseEpisodeRequest`/``BaseEpisodeResponse``) and implements
  :meth:`BaseEnvironmentServer.run`; ``POST /run`` validates the body, runs the episode and returns its
  response; ``POST /aggregate_metrics`` aggregates a run's results (default: the verify-response
  aggregation every agent has, over each result's fields).
* Every episode is bounded. Admission: at most ``max_concurrent_episodes`` at once, each waiting at most
  ``queue_timeout_seconds`` (required with it) for a place. Run: at most ``default_episode_timeout_seconds``
  (upstream leaves it unbounded when unset; here unset means :data:`DEFAULT_EPISODE_TIMEOUT_S`). Clean-up:
  the callbacks registered on the episode's :class:`CleanupContext` run last-registered first, each at
  most once, all within ``cleanup_timeout_seconds`` (default 180 s; upstream requires it), whatever
  the episode did, and a failing callback is logged and does not stop the others.
* An episode that could not finish answers with an :class:`~nemo_gym.server.episodes.EpisodeFailure`,
  never with a made-up result: admission timed out (``stage: admission``, not terminal), the episode
  timed out (not terminal), :class:`HandledEpisodeError` (its failure), anything else raised
  (terminal, the error named). A response for another episode or task than the request's is a 500.
* A cancelled request (the caller went away) still runs the clean-up, then stays cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import FastAPI
from pydantic import ConfigDict, PositiveFloat, PositiveInt, model_validator

from nemo_gym.config.types import AggregateMetrics, AggregateMetricsRequest, BaseRunServerInstanceConfig
from nemo_gym.kit.reward_profile import AggregateMetricsMixin
from nemo_gym.server.base import SimpleServer
from nemo_gym.server.episodes import BaseEpisodeRequest, BaseEpisodeResponse, EpisodeFailure, EpisodeId

LOG = logging.getLogger(__name__)

# An episode's bound when its config sets none: six hours.
DEFAULT_EPISODE_TIMEOUT_S = 21600.0
DEFAULT_CLEANUP_TIMEOUT_S = 180.0
MAX_FAILURE_REASON_CHARS = 2000

EpisodeRequestT = TypeVar("EpisodeRequestT", bound=BaseEpisodeRequest[Any])
EpisodeResponseT = TypeVar("EpisodeResponseT", bound=BaseEpisodeResponse[Any])
CleanupCallback = Callable[[], Awaitable[None]]


class BaseEnvironmentServerConfig(BaseRunServerInstanceConfig):
    """The episode bounds every environment server has (upstream's keys)."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_episodes: PositiveInt | None = None
    queue_timeout_seconds: PositiveFloat | None = None
    default_episode_timeout_seconds: PositiveFloat | None = None
    cleanup_timeout_seconds: PositiveFloat = DEFAULT_CLEANUP_TIMEOUT_S

    @model_validator(mode="after")
    def _queue_bound_with_a_limit(self) -> BaseEnvironmentServerConfig:
        if self.max_concurrent_episodes is not None and self.queue_timeout_seconds is None:
            raise ValueError("queue_timeout_seconds is required when max_concurrent_episodes is set")
        return self

    @property
    def episode_timeout_s(self) -> float:
        """The bound of one episode: ``default_episode_timeout_seconds``, else six hours."""
        return float(self.default_episode_timeout_seconds or DEFAULT_EPISODE_TIMEOUT_S)


@dataclass
class _Cleanup:
    name: str
    callback: CleanupCallback
    done: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run_once(self) -> None:
        async with self.lock:
            if not self.done:
                await self.callback()
                self.done = True


@dataclass
class CleanupHandle:
    """Runs one registered clean-up now (at a protocol boundary) rather than at the episode's end."""

    entry: _Cleanup
    timeout_seconds: float

    async def close(self) -> None:
        """Run the callback if it has not run; at most ``timeout_seconds``. It will not run again."""
        async with asyncio.timeout(self.timeout_seconds):
            await self.entry.run_once()


@dataclass
class CleanupContext:
    """The clean-ups of one episode: run last-registered first, once each, within one bound.

    Callbacks live in this process: a crash loses them, so whatever they release remotely needs an
    expiry of its own. They must be idempotent (a timed-out remote close may still have happened)."""

    episode_id: EpisodeId
    cleanup_timeout_seconds: float
    _entries: list[_Cleanup] = field(default_factory=list)

    def register_cleanup(self, name: str, callback: CleanupCallback) -> CleanupHandle:
        entry = _Cleanup(name, callback)
        self._entries.append(entry)
        return CleanupHandle(entry, self.cleanup_timeout_seconds)

    async def aclose(self) -> None:
        """Run every clean-up not yet run, newest first; errors are logged, the bound is the context's."""

        async def unwind() -> None:
            for entry in reversed(self._entries):
                try:
                    await entry.run_once()
                except Exception:
                    LOG.exception("clean-up %r of episode %s failed", entry.name, self.episode_id.capture_key)

        try:
            async with asyncio.timeout(self.cleanup_timeout_seconds):
                await unwind()
        except TimeoutError:
            LOG.error(
                "clean-up of episode %s passed its bound of %s s",
                self.episode_id.capture_key,
                self.cleanup_timeout_seconds,
            )


class HandledEpisodeError(Exception):
    """Raised inside :meth:`BaseEnvironmentServer.run` to answer with ``failure`` instead of a result."""

    def __init__(self, failure: EpisodeFailure) -> None:
        super().__init__(failure.failure_reason)
        self.failure = failure


class BaseEnvironmentServer(SimpleServer, AggregateMetricsMixin, Generic[EpisodeRequestT, EpisodeResponseT]):
    """``POST /run`` for one episode with the bounds and clean-up above; subclasses implement :meth:`run`."""

    config: BaseEnvironmentServerConfig
    request_model: ClassVar[type[BaseEpisodeRequest[Any]]]
    response_model: ClassVar[type[BaseEpisodeResponse[Any]]]
    metrics_kind: ClassVar[str] = "environment_servers"
    uses_sessions: ClassVar[bool] = False
    _admission: asyncio.Semaphore | None = None

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        limit = self.config.max_concurrent_episodes
        self._admission = asyncio.Semaphore(limit) if limit is not None else None

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()

        async def run_endpoint(body: Any) -> Any:
            return await self.run_request(body)

        async def aggregate_metrics_endpoint(body: Any) -> Any:
            return await self.aggregate_metrics(body)

        # The body and answer types are the subclass's: set on the functions, where FastAPI reads them.
        run_endpoint.__annotations__.update(body=self.request_model, **{"return": self.response_model})
        aggregate_metrics_endpoint.__annotations__.update(
            body=AggregateMetricsRequest, **{"return": AggregateMetrics}
        )
        app.post("/run", response_model=self.response_model)(run_endpoint)
        app.post("/aggregate_metrics", response_model=AggregateMetrics)(aggregate_metrics_endpoint)
        return app

    @contextlib.asynccontextmanager
    async def episode_slot(self) -> AsyncIterator[str | None]:
        """Hold one of the ``max_concurrent_episodes`` places while the block runs; yields None, or (holding
        nothing) why there was no place within ``queue_timeout_seconds``."""
        if self._admission is None:
            yield None
            return
        try:
            await asyncio.wait_for(self._admission.acquire(), timeout=self.config.queue_timeout_seconds)
        except TimeoutError:
            yield (
                f"no episode slot within queue_timeout_seconds={self.config.queue_timeout_seconds} "
                f"(max_concurrent_episodes={self.config.max_concurrent_episodes})"
            )
            return
        try:
            yield None
        finally:
            self._admission.release()

    async def run_request(self, request: EpisodeRequestT) -> EpisodeResponseT:
        """One episode through admission, its bound and its clean-up (what ``POST /run`` calls)."""
        async with self.episode_slot() as refused:
            if refused is not None:
                return self.failure_response(
                    request, EpisodeFailure(failure_reason=refused, terminal=False, stage="admission")
                )
            response = await self._bounded_episode(request)
        response = self.response_model.model_validate(response)
        self.validate_response_identity(request, response)
        return response  # type: ignore[return-value]

    async def _bounded_episode(self, request: EpisodeRequestT) -> Any:
        cleanup = CleanupContext(request.episode_id, float(self.config.cleanup_timeout_seconds))
        bound = self.config.episode_timeout_s
        try:
            try:
                async with asyncio.timeout(bound) as deadline:
                    return await self.run(request, cleanup)
            except TimeoutError as exc:
                if deadline.expired():
                    reason = f"the episode passed its bound of {bound:g} s (default_episode_timeout_seconds)"
                    return self.failure_response(
                        request, EpisodeFailure(failure_reason=reason, terminal=False)
                    )
                return self._unhandled(request, exc)
            except HandledEpisodeError as exc:
                return self.failure_response(request, exc.failure)
            except Exception as exc:
                return self._unhandled(request, exc)
        finally:
            # Shielded: a caller that went away still gets its episode's resources released.
            await asyncio.shield(cleanup.aclose())

    def _unhandled(self, request: EpisodeRequestT, exc: BaseException) -> Any:
        LOG.exception("episode %s of %s failed", request.episode_id.capture_key, self.config.name)
        reason = f"environment server error: {type(exc).__name__}: {exc}"
        return self.failure_response(
            request, EpisodeFailure(failure_reason=reason[:MAX_FAILURE_REASON_CHARS], terminal=True)
        )

    @abstractmethod
    async def run(self, request: EpisodeRequestT, cleanup: CleanupContext) -> EpisodeResponseT:
        """Run one episode of this environment's protocol; register what must be released on ``cleanup``."""

    def failure_response(self, request: EpisodeRequestT, failure: EpisodeFailure) -> EpisodeResponseT:
        """The response of ``request``'s episode carrying ``failure`` instead of a result."""
        return self.response_model.model_validate(  # type: ignore[return-value]
            {
                "episode_id": request.episode_id,
                "task_id": request.task.task_id,
                "failure": failure.model_dump(mode="json"),
            }
        )

    @staticmethod
    def validate_response_identity(request: EpisodeRequestT, response: EpisodeResponseT) -> None:
        """Raise ``ValueError`` when ``response`` answers another episode or task than ``request``."""
        if response.episode_id != request.episode_id:
            raise ValueError(
                f"response episode_id {response.episode_id} is not the request's {request.episode_id}"
            )
        if response.task_id != request.task.task_id:
            raise ValueError(
                f"response task_id {response.task_id} is not the request's {request.task.task_id}"
            )
