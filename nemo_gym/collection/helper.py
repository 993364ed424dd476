"""The trainers' Python API: :class:`RolloutCollectionHelper` (upstream's name and call shape).

Contract
--------
* ``run_examples(rows, head_server_config=...)`` starts the rows from a running event loop and yields
  awaitables in completion order, each giving ``(row, result)``: the very dict passed in and the
  agent's ``/run`` JSON as it returned it. At most ``num_samples_in_parallel`` (or the given
  semaphore's) rollouts are in flight; a row gets its task only when it may start (in order), so
  memory is O(in flight) plus the results not yet awaited, never one task per row.
* An infrastructure failure raises :class:`UpstreamError`; after ``circuit_breaker_threshold``
  consecutive failures of one down server (all its replicas dead), the rows of that call not yet sent
  to the affected agents raise :class:`ServerDownError` instead of being sent.
* Each result gets ``policy_versions`` (the policy versions its model calls used, once a trainer has
  set one on the model server). With ``max_policy_lag``, a result is judged when its awaitable is
  awaited, against the current version of ``policy_version_model``: a stale one is marked
  (``stale_policy="mark"``: ``stale_policy: true``, ``policy_lag``) or its awaitable raises
  :class:`~nemo_gym.collection.policy_lag.StalePolicyError` (``"drop"``; not an infrastructure failure).
* One :class:`ServerClient` per head server is kept; :meth:`RolloutCollectionHelper.aclose` closes
  this event loop's HTTP connections.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Iterator, Sized
from typing import Any

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.client.replicas import replicated_instances
from nemo_gym.client.server_client import ServerClient, close_shared_session, live_replicas
from nemo_gym.collection.circuit_breaker import CircuitBreaker, ServerDownError, classify_failure
from nemo_gym.collection.dispatch import post_run
from nemo_gym.collection.policy_lag import (
    DEFAULT_POLICY_VERSION_MODEL,
    PolicyLagFilter,
    StalePolicy,
    StalePolicyError,
)
from nemo_gym.collection.routing import EnvironmentRouter
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.errors import UpstreamError


class RolloutCollectionHelper:
    """Run task rows through running agents from Python.

    ``for future in RolloutCollectionHelper().run_examples(rows, head_server_config=...):``
    ``    row, result = await future`` — futures complete in any order; at most
    ``num_samples_in_parallel`` rollouts are in flight. ``result`` is the verify response (with
    ``reward`` and every output item's token-id fields, when the model returns them).

    When ``circuit_breaker_threshold`` rollouts in a row fail because one server is down, the rows
    of that call not yet sent to the affected agent are not sent: their awaitables raise
    :class:`ServerDownError` (an :class:`UpstreamError`) naming the down server.
    """

    def __init__(
        self,
        num_samples_in_parallel: int = 256,
        request_timeout_s: float = 3600.0,
        circuit_breaker_threshold: int = 3,
        max_policy_lag: int | None = None,
        stale_policy: StalePolicy = "drop",
        policy_version_model: str = DEFAULT_POLICY_VERSION_MODEL,
    ) -> None:
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag!r}")
        if stale_policy not in ("drop", "mark"):
            raise ValueError(f"stale_policy must be 'drop' or 'mark', got {stale_policy!r}")
        if circuit_breaker_threshold < 1:
            raise ValueError(f"circuit_breaker_threshold must be >= 1, got {circuit_breaker_threshold!r}")
        raise_open_file_limit()
        self.num_samples_in_parallel = num_samples_in_parallel
        self.request_timeout_s = request_timeout_s
        self.circuit_breaker_threshold = circuit_breaker_threshold
        self.max_policy_lag = max_policy_lag
        self.stale_policy: StalePolicy = stale_policy
        self.policy_version_model = policy_version_model
        self._clients: dict[tuple[str, int], ServerClient] = {}
        self._starters: set[asyncio.Future[None]] = set()

    def _client(self, head: BaseServerConfig | None) -> ServerClient:
        key = (head.host, head.port) if head else ("", 0)
        if key not in self._clients:
            self._clients[key] = ServerClient.load_from_global_config(head)
        return self._clients[key]

    def run_examples(
        self,
        examples: list[dict[str, Any]],
        head_server_config: BaseServerConfig | None = None,
        semaphore: asyncio.Semaphore | None = None,
        environment_server_name: str | None = None,
    ) -> Iterator[Awaitable[tuple[dict[str, Any], dict[str, Any]]]]:
        """Start the examples now (call from a running event loop); yield awaitables in completion order.

        Each awaitable gives ``(row, result)``: ``row`` is the very dict passed in (nothing added),
        ``result`` the agent's ``/run`` JSON as it returned it (upstream's semantics; the verify
        response echoes the row's fields, so indices a row carries come back). ``semaphore`` bounds
        the rollouts in flight (default: ``num_samples_in_parallel``). An infrastructure failure
        raises :class:`UpstreamError` (``.status`` is the HTTP status, None when no answer came), and
        a row held back because a server is down raises :class:`ServerDownError`.

        The rows start in order as the semaphore lets them: a task exists only for a rollout in
        flight, never one per row up front, so memory is O(in flight) plus the finished results not
        yet awaited. (With a semaphore shared by several calls, their rows take turns.)

        With environment servers in the config (NeMo Gym 0.7), a row goes through the one that fronts its
        agent, or through ``environment_server_name`` when given (:mod:`nemo_gym.collection.routing`); an
        agent that several front fails its rows' awaitables with ``ValueError`` naming them.
        """
        client = self._client(head_server_config)
        router = EnvironmentRouter(client.global_config_dict, environment_server_name)
        lag_filter = PolicyLagFilter(
            client, self.max_policy_lag, self.stale_policy, self.policy_version_model
        )
        if semaphore is None:
            semaphore = asyncio.Semaphore(self.num_samples_in_parallel)
        breaker = CircuitBreaker(
            self.circuit_breaker_threshold, replicated_instances(client.global_config_dict)
        )
        probe = functools.partial(live_replicas, client)
        loop = asyncio.get_running_loop()
        rows = examples if isinstance(examples, Sized) else list(examples)
        finished: asyncio.Queue[asyncio.Future[tuple[dict[str, Any], dict[str, Any]]]] = asyncio.Queue()

        def failed(error: BaseException) -> None:
            future: asyncio.Future[Any] = loop.create_future()
            future.set_exception(error)
            finished.put_nowait(future)

        async def one(
            row: dict[str, Any], agent: str, via: str | None
        ) -> tuple[dict[str, Any], dict[str, Any]]:
            try:
                result = await post_run(client, row, self.request_timeout_s, via)
            except UpstreamError as e:
                await breaker.record_failure(agent, classify_failure(e, agent), probe)
                raise
            breaker.success(agent)
            return row, result

        in_flight: set[asyncio.Future[Any]] = set()  # held while they run: the loop's references are weak

        def ended(task: asyncio.Future[Any]) -> None:
            in_flight.discard(task)
            semaphore.release()
            finished.put_nowait(task)

        async def start_all() -> None:
            for row in rows:
                try:
                    if not isinstance(row.get("agent_ref"), dict) or "name" not in row["agent_ref"]:
                        raise ValueError("each example needs agent_ref: {name: <agent instance>}")
                    agent = row["agent_ref"]["name"]
                    via = router(agent)
                except Exception as e:  # a bad row fails its own awaitable, as a task of it would
                    failed(e)
                    continue
                await semaphore.acquire()
                opened = breaker.blocking(agent)
                if opened is not None:
                    semaphore.release()
                    failed(ServerDownError(agent, opened))
                    continue
                task = asyncio.ensure_future(one(row, agent, via))
                in_flight.add(task)
                task.add_done_callback(ended)

        starter = asyncio.ensure_future(start_all())
        self._starters.add(starter)  # held until it ends, as the rollout tasks are
        starter.add_done_callback(self._starters.discard)

        async def next_finished() -> tuple[dict[str, Any], dict[str, Any]]:
            row, result = (await finished.get()).result()
            # Judged as the caller takes it: the lag is against the version current now.
            stale = await lag_filter.judge(result)
            if stale is not None and self.stale_policy == "drop":
                raise StalePolicyError(row, result, *stale)
            return row, result

        return (next_finished() for _ in range(len(rows)))

    async def aclose(self) -> None:
        """Close this event loop's HTTP connections (optional; avoids "unclosed session" warnings)."""
        await close_shared_session()
