"""Sending rows to agents: one ``/run`` call, and a bounded, lazily-fed map over many.

Contract
--------
* :func:`post_run` POSTs a row to its agent's ``/run`` (or to the environment server in front of it,
  :mod:`.routing`) and returns the JSON as it was returned;
  a non-2xx raises :class:`UpstreamError` carrying the status, the parsed (or cut) body and the raw
  body as ``response_content``. :func:`run_one` stamps the result with the row's indices and
  ``agent_ref``.
* :func:`bounded_map` keeps at most ``limit`` workers in flight, reads its rows lazily and yields each
  result as it ends (O(1) per completion). ``stop`` cancels the work in flight (finished work is still
  yielded); ``halt()`` only stops new work. No task outlives the generator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import orjson

from nemo_gym.client.server_client import ServerClient
from nemo_gym.config.keys import ENVIRONMENT_SERVER_STAMP_KEY_NAME
from nemo_gym.errors import UpstreamError, response_body


async def run_one(
    client: ServerClient, row: dict[str, Any], timeout_s: float, via: str | None = None
) -> dict[str, Any]:
    """POST one materialized row to its agent's /run (or to environment server ``via`` in front of it); a
    non-2xx raises UpstreamError.

    The result is stamped with the row's task/rollout indices and ``agent_ref`` (and
    ``_ng_environment_server`` when it went through one)."""
    result = await post_run(client, row, timeout_s, via)
    result["_ng_task_index"] = row["_ng_task_index"]
    result["_ng_rollout_index"] = row["_ng_rollout_index"]
    result["agent_ref"] = row["agent_ref"]
    if via is not None:
        result[ENVIRONMENT_SERVER_STAMP_KEY_NAME] = via
    return result


async def post_run(
    client: ServerClient, row: dict[str, Any], timeout_s: float, via: str | None = None
) -> dict[str, Any]:
    """The ``/run`` JSON for ``row`` of its agent (or of environment server ``via``), as returned."""
    server = via or row["agent_ref"]["name"]
    resp = await client.post(server, "/run", json=row, timeout_s=timeout_s)
    if resp.status >= 300:
        body = response_body(resp)
        try:
            detail: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            detail = body.decode(errors="replace")[:4000]
        kind = "server_error" if resp.status >= 500 else "client_error"
        error = UpstreamError(server, "/run", resp.status, detail, kind=kind)
        error.response_content = body  # the raw body, as upstream's error carries it (NeMo RL prints it)
        raise error
    return orjson.loads(response_body(resp))


async def bounded_map(
    rows: Iterable[dict[str, Any]],
    worker: Any,
    limit: int,
    stop: asyncio.Event | None = None,
    halt: Callable[[], bool] | None = None,
) -> AsyncIterator[tuple[dict[str, Any], Any, BaseException | None]]:
    """Run ``worker(row)`` with at most ``limit`` in flight, reading ``rows`` lazily; yield as each ends.

    Completions arrive through a queue (O(1) each), so 16k rollouts in flight cost no more per
    completion than 16. When ``stop`` is set, nothing new starts, work that has already finished is
    still yielded, and the rest of the in-flight work is cancelled. Once ``halt()`` is true, nothing
    new starts and the work in flight runs to its end.
    """
    pending: dict[asyncio.Future, dict[str, Any]] = {}
    finished: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    it = iter(rows)
    exhausted = False
    watcher = None
    if stop is not None:
        watcher = asyncio.ensure_future(stop.wait())
        watcher.add_done_callback(lambda _: finished.put_nowait(None))

    def fill() -> None:
        nonlocal exhausted
        while not exhausted and len(pending) < limit and not (stop and stop.is_set() or halt and halt()):
            try:
                row = next(it)
            except StopIteration:
                exhausted = True
                return
            task = asyncio.ensure_future(worker(row))
            pending[task] = row
            task.add_done_callback(finished.put_nowait)

    try:
        fill()
        while pending:
            task = await finished.get()
            if task is None:  # stop requested: hand out what already finished, cancel the rest
                for done_task in [t for t in pending if t.done() and not t.cancelled()]:
                    row = pending.pop(done_task)
                    exc = done_task.exception()
                    yield row, (None if exc else done_task.result()), exc
                return
            row = pending.pop(task)
            if task.cancelled():
                continue
            exc = task.exception()
            yield row, (None if exc else task.result()), exc
            fill()
    finally:
        if watcher is not None:
            watcher.cancel()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
