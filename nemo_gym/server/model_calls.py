"""Model-call capture (``+observability_enabled=true``): every model call of a rollout, next to the rollout.

Contract
--------
* Off (the default) nothing is installed: a model server answers exactly as before, with no per-request
  cost, and ``POST /ng_model_calls/pop`` answers ``{"enabled": false, "calls": {}, ...}``.
* On, every model server of ours (:class:`nemo_gym.server.model.SimpleResponsesAPIModel`)
  records each ``POST`` to ``/v1/responses``, ``/v1/chat/completions``, ``/v1/messages`` or
  ``/v1/completions`` (streamed or not: a stream's events are recorded as one object) that arrives
  under a rollout prefix (``/ng-rollout/<id>/...``, see :mod:`nemo_gym.server.rollout_prefix`; agents
  add it when the run sets ``observability_enabled``): the request and response bodies,
  started/completed timestamps, latency, the usage (token counts) the answer reports, the HTTP status, and for a failed call an
  ``error_category`` and ``error`` text (a call that raised is recorded as a 500 before the error
  middleware answers it), and the server's ``policy_version`` when the call started
  (:mod:`nemo_gym.server.policy_version`; None until a trainer sets one). A call without a rollout
  prefix is answered and not recorded.
* The store is bounded (:class:`ModelCallStore`): at most ``model_call_capture_max_calls`` calls and
  ``model_call_capture_max_bytes`` bytes of bodies per model server (top-level config keys); past
  either bound the oldest calls are dropped and counted per rollout. A single call larger than the
  byte bound keeps its metadata and drops its bodies (``payload_omitted``).
* ``POST /ng_model_calls/pop {"rollout_ids": [...]}`` (behind the run token like every route) returns
  and removes those rollouts' calls and drop counts.
* The collector (:class:`ModelCallSink`, used by ``ng_collect_rollouts`` and
  ``ng_e2e_collect_rollouts``) pops each rollout's calls from every model server as soon as the rollout
  ends (finished or failed), and appends them to ``<output stem>_model_calls.jsonl``: one line per
  call, ``kind: "model_call"``, carrying the row's ``_ng_task_index`` / ``_ng_rollout_index`` /
  ``agent_ref`` and ``rollout_status`` (``ok`` or ``failed``), in the order the calls started; a
  rollout that lost calls to the bound gets one ``kind: "dropped"`` line with the count. Every line
  is scrubbed of known secrets (:mod:`nemo_gym.redaction`) before it is written. A model server that
  cannot be asked is counted (``pull_errors``) and warned about; it never fails the rollout. Before
  sending, the collector drops what the servers still hold for the rollout ids it is about to run
  (calls of an earlier, interrupted run: ``stale_discarded``), so a resumed rollout's lines are its own.
  Two collections against the same servers at once must not share task/rollout indices.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym.config.flags import config_flag
from nemo_gym.server.rollout_prefix import current_rollout_id, maybe_rollout_id_from_run_body

logger = logging.getLogger("nemo_gym")

OBSERVABILITY_ENABLED_KEY_NAME = "observability_enabled"  # upstream's key
MAX_CALLS_KEY_NAME = "model_call_capture_max_calls"
MAX_BYTES_KEY_NAME = "model_call_capture_max_bytes"
DEFAULT_MAX_CALLS = 10_000
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
POP_PATH = "/ng_model_calls/pop"
CAPTURED_PATHS = {
    "/v1/responses": "responses",
    "/v1/chat/completions": "chat_completions",
    "/v1/messages": "messages",
    "/v1/completions": "completions",
}
MODEL_SERVER_TYPE = "responses_api_models"
_ENTRY_OVERHEAD_BYTES = 512  # metadata of one stored call, counted against the byte bound
_MAX_ERROR_CHARS = 2000
_MAX_DROP_COUNTS = 100_000  # rollouts whose drop counts are kept until asked for (a few MB at most)


def model_calls_path(output: str | os.PathLike[str]) -> Path:
    """``<output stem>_model_calls.jsonl``: where the collector writes the calls of ``output``'s rollouts."""
    output = Path(output)
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return Path(f"{stem}_model_calls.jsonl")


def observability_enabled(global_config: Mapping[str, Any] | None) -> bool:
    """Whether the run's config turns model-call capture on."""
    return config_flag(global_config, OBSERVABILITY_ENABLED_KEY_NAME, False)


# ------------------------------------------------------------------------------------------------
# Model-server side: the bounded store and the capturing middleware.


@dataclass
class _Call:
    rollout_id: str
    meta: dict[str, Any]
    request: bytes | None
    response: bytes | None
    size: int


class ModelCallStore:
    """Captured calls keyed by rollout id, oldest dropped first past ``max_calls`` or ``max_bytes``."""

    def __init__(self, max_calls: int = DEFAULT_MAX_CALLS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_calls < 1 or max_bytes < 1:
            raise ValueError(f"capture bounds must be >= 1, got max_calls={max_calls}, max_bytes={max_bytes}")
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self._order: OrderedDict[int, _Call] = OrderedDict()  # every stored call, oldest first
        self._by_rollout: dict[str, deque[int]] = {}
        self._dropped: OrderedDict[str, int] = OrderedDict()  # per rollout, bounded too
        self._seq = itertools.count()
        self._call_index: dict[str, int] = {}
        self.bytes = 0
        self.dropped_total = 0

    def __len__(self) -> int:
        return len(self._order)

    def add(
        self, rollout_id: str, meta: dict[str, Any], request: bytes | None, response: bytes | None
    ) -> None:
        """Store one call of ``rollout_id`` (``meta`` gets its ``call_index``), dropping the oldest as needed."""
        size = len(request or b"") + len(response or b"") + _ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:  # keep what the call was, without its bodies
            request = response = None
            meta["payload_omitted"] = f"bodies larger than {MAX_BYTES_KEY_NAME}={self.max_bytes}"
            size = _ENTRY_OVERHEAD_BYTES
        index = self._call_index.get(rollout_id, 0)
        self._call_index[rollout_id] = index + 1
        meta["call_index"] = index
        seq = next(self._seq)
        self._order[seq] = _Call(rollout_id, meta, request, response, size)
        self._by_rollout.setdefault(rollout_id, deque()).append(seq)
        self.bytes += size
        while len(self._order) > self.max_calls or self.bytes > self.max_bytes:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        seq, call = self._order.popitem(last=False)
        self.bytes -= call.size
        seqs = self._by_rollout[call.rollout_id]
        seqs.popleft()  # a rollout's calls are stored in order, so its oldest is this one
        if not seqs:
            del self._by_rollout[call.rollout_id]  # its call_index stays: later calls keep counting
        self.dropped_total += 1
        self._dropped[call.rollout_id] = self._dropped.pop(call.rollout_id, 0) + 1
        while len(self._dropped) > max(self.max_calls, _MAX_DROP_COUNTS):  # counts nobody asks for go too
            forgotten, _ = self._dropped.popitem(last=False)
            if forgotten not in self._by_rollout:
                self._call_index.pop(forgotten, None)

    def pop(self, rollout_ids: list[str]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
        """Remove and return the calls (bodies parsed) and drop counts of ``rollout_ids``."""
        calls: dict[str, list[dict[str, Any]]] = {}
        dropped: dict[str, int] = {}
        for rid in rollout_ids:
            n = self._dropped.pop(rid, 0)
            if n:
                dropped[rid] = n
            seqs = self._by_rollout.pop(rid, None)
            self._call_index.pop(rid, None)
            if not seqs:
                continue
            out = []
            for seq in seqs:
                call = self._order.pop(seq)
                self.bytes -= call.size
                out.append({**call.meta, "request": _parse(call.request), "response": _parse(call.response)})
            calls[rid] = out
        return calls, dropped


def _parse(body: bytes | None) -> Any:
    if body is None:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        if body.startswith((b"event:", b"data:")):
            return _parse_event_stream(body)
        return body.decode(errors="replace")


_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _parse_event_stream(body: bytes) -> dict[str, Any]:
    """A streamed answer (server-sent events of any of the APIs) as one object: a Responses stream's final
    response (``response.completed`` / ``response.incomplete``), else what the events carried at their end:
    the ``usage`` and the token-id fields (Chat: on the final chunk's delta; Messages: on
    ``message_delta``). ``event_stream: true`` and the number of ``events`` say it was streamed."""
    out: dict[str, Any] = {"event_stream": True, "events": 0}
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        out["events"] += 1
        if event.get("type") in ("response.completed", "response.incomplete") and isinstance(
            event.get("response"), dict
        ):
            return {**event["response"], "event_stream": True, "events": out["events"]}
        if isinstance(event.get("usage"), dict):
            out["usage"] = event["usage"]
        carriers = [event]
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("delta"), dict):
                carriers.append(choice["delta"])
        for carrier in carriers:
            for key in _TOKEN_FIELDS:
                if carrier.get(key) is not None:
                    out[key] = carrier[key]
    return out


def _usage_of(parsed: Any) -> dict[str, Any] | None:
    """The token counts a Responses or Chat Completions answer reports (None: not reported)."""
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    if not isinstance(usage, dict):
        return None
    tokens_in = usage.get("input_tokens", usage.get("prompt_tokens"))
    tokens_out = usage.get("output_tokens", usage.get("completion_tokens"))
    total = usage.get("total_tokens")
    if total is None and isinstance(tokens_in, int) and isinstance(tokens_out, int):
        total = tokens_in + tokens_out
    return {"tokens_in": tokens_in, "tokens_out": tokens_out, "tokens_total": total, "usage": usage}


def _error_text(parsed: Any, raw: bytes) -> str:
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        inner = error.get("inner")
        text = error.get("message") or (inner.get("error") if isinstance(inner, dict) else None)
        text = text or orjson.dumps(error).decode()
    elif isinstance(parsed, dict) and "detail" in parsed:
        text = str(parsed["detail"])
    else:
        text = raw.decode(errors="replace")
    return str(text)[:_MAX_ERROR_CHARS]


class ModelCallCaptureMiddleware:
    """Pure ASGI middleware (innermost on a model server): records prefixed model calls in a store."""

    def __init__(
        self,
        app: Any,
        store: ModelCallStore,
        model_ref: dict[str, str],
        policy_version: Callable[[], Any] | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.model_ref = model_ref
        # The server's current policy version (nemo_gym.server.policy_version), read as the call starts.
        self.policy_version = policy_version

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        rollout_id = current_rollout_id()
        dialect = CAPTURED_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if rollout_id is None or dialect is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        request_chunks: list[bytes] = []
        response_chunks: list[bytes] = []
        status: list[int] = []

        async def receive_recording() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                request_chunks.append(message.get("body", b""))
            return message

        async def send_recording(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                response_chunks.append(message.get("body", b""))
            await send(message)

        started_at = time.time()
        version = self.policy_version() if self.policy_version is not None else None
        t0 = time.perf_counter()
        raised: BaseException | None = None
        try:
            await self.app(scope, receive_recording, send_recording)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raised = exc
            raise
        finally:
            latency_ms = (time.perf_counter() - t0) * 1000.0
            try:
                self._record(
                    rollout_id, dialect, scope, started_at, latency_ms, request_chunks, response_chunks,
                    status, raised, version,
                )  # fmt: skip
            except Exception:  # capture must never break a model call
                logger.exception("model-call capture failed for rollout %s", rollout_id)

    def _record(
        self,
        rollout_id: str,
        dialect: str,
        scope: dict[str, Any],
        started_at: float,
        latency_ms: float,
        request_chunks: list[bytes],
        response_chunks: list[bytes],
        status: list[int],
        raised: BaseException | None,
        policy_version: Any = None,
    ) -> None:
        request = b"".join(request_chunks)
        response = b"".join(response_chunks) if status else None
        code = 500 if raised is not None and not status else (status[0] if status else None)
        meta: dict[str, Any] = {
            "model_call_id": uuid.uuid4().hex,
            "rollout_id": rollout_id,
            "model_ref": self.model_ref,
            "dialect": dialect,
            "path": scope.get("path"),
            "started_at": started_at,
            "completed_at": started_at + latency_ms / 1000.0,
            "latency_ms": round(latency_ms, 3),
            "status_code": code,
            "error_category": None,
            "error": None,
            "tokens_in": None,
            "tokens_out": None,
            "tokens_total": None,
            "usage": None,
            "policy_version": policy_version,
        }
        parsed = _parse(response) if response else None
        if raised is not None:
            meta["error_category"] = "exception"
            meta["error"] = f"{type(raised).__name__}: {raised}"[:_MAX_ERROR_CHARS]
        elif code is not None and code >= 400:
            meta["error_category"] = "server_error" if code >= 500 else "client_error"
            meta["error"] = _error_text(parsed, response or b"")
        else:
            usage = _usage_of(parsed)
            if usage:
                meta.update(usage)
            if isinstance(parsed, dict):
                meta["response_id"] = parsed.get("id")
                meta["response_status"] = parsed.get("status")
        self.store.add(rollout_id, meta, request, response)


class PopModelCallsRequest(BaseModel):
    """Body of ``POST /ng_model_calls/pop``."""

    model_config = ConfigDict(extra="forbid")

    rollout_ids: list[str] = Field(max_length=100_000)


def store_from_config(global_config: Mapping[str, Any] | None) -> ModelCallStore | None:
    """A store sized by the config's bounds when capture is on, else None (nothing installed)."""
    if not observability_enabled(global_config):
        return None
    assert global_config is not None
    max_calls = global_config.get(MAX_CALLS_KEY_NAME)
    max_bytes = global_config.get(MAX_BYTES_KEY_NAME)
    try:
        return ModelCallStore(
            int(DEFAULT_MAX_CALLS if max_calls is None else max_calls),
            int(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{MAX_CALLS_KEY_NAME} and {MAX_BYTES_KEY_NAME} must be integers >= 1: {e}"
        ) from None


def pop_answer(store: ModelCallStore | None, body: PopModelCallsRequest) -> dict[str, Any]:
    """The JSON of ``POST /ng_model_calls/pop`` for ``store`` (None: capture is off)."""
    if store is None:
        return {"enabled": False, "calls": {}, "dropped": {}, "stored_calls": 0, "dropped_total": 0}
    calls, dropped = store.pop(body.rollout_ids)
    return {
        "enabled": True,
        "calls": calls,
        "dropped": dropped,
        "stored_calls": len(store),
        "dropped_total": store.dropped_total,
    }


# ------------------------------------------------------------------------------------------------
# Collector side.


def capture_wanted(client: Any, requested: bool | None) -> bool:
    """Whether the collector pulls model calls: ``requested`` (its ``observability_enabled``) None follows
    the servers' config, False never pulls, True requires the servers to capture (else a ``ValueError``
    saying how to start them)."""
    servers_on = observability_enabled(client.global_config_dict)
    if requested and not servers_on:
        raise ValueError(
            "+observability_enabled=true was given to the collector, but the running servers were not "
            "started with it, so no model call is recorded: restart ng_run with +observability_enabled=true "
            "(or drop the option here)."
        )
    return servers_on and requested is not False


def model_server_names(global_config: Mapping[str, Any]) -> list[str]:
    """The instance names of every configured model server."""
    names = []
    for name, block in global_config.items():
        if isinstance(block, Mapping) and isinstance(block.get(MODEL_SERVER_TYPE), Mapping):
            names.append(str(name))
    return names


@dataclass
class ModelCallSink:
    """Pops each finished rollout's model calls from every model server and appends them to a file."""

    client: Any  # nemo_gym.client.server_client.ServerClient
    writer: Any  # has write(obj) and close(): nemo_gym.collection.output_files.LineWriter
    servers: list[str]
    calls_written: int = 0
    dropped: int = 0
    pull_errors: int = 0
    stale_discarded: int = 0
    _warned: set[str] = field(default_factory=set)

    @classmethod
    def for_client(cls, client: Any, writer: Any) -> ModelCallSink:
        """A sink asking every model server in ``client``'s config, appending with ``writer``."""
        return cls(client=client, writer=writer, servers=model_server_names(client.global_config_dict))

    def wrap(
        self, worker: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        """``worker`` followed by writing the row's model calls (also when it failed; not when cancelled)."""

        async def run(row: dict[str, Any]) -> Any:
            try:
                result = await worker(row)
            except asyncio.CancelledError:
                raise
            except BaseException:
                await self.write_rollout(row, "failed")
                raise
            await self.write_rollout(row, "ok")
            return result

        return run

    async def pop(self, rollout_id: str) -> tuple[list[dict[str, Any]], int]:
        """All model servers' calls of ``rollout_id`` (in start order) and how many were dropped."""
        from nemo_gym.errors import UpstreamError, response_body

        calls: list[dict[str, Any]] = []
        dropped = 0
        for server in self.servers:
            try:
                resp = await self.client.post(
                    server, POP_PATH, json={"rollout_ids": [rollout_id]}, timeout_s=60
                )
                body = response_body(resp)
                if resp.status != 200:
                    raise UpstreamError(server, POP_PATH, resp.status, body[:500].decode(errors="replace"))
                answer = orjson.loads(body)
            except (UpstreamError, orjson.JSONDecodeError) as e:
                self.pull_errors += 1
                if server not in self._warned:
                    self._warned.add(server)
                    logger.warning("model-call capture: cannot get the calls from %s: %s", server, e)
                continue
            calls.extend(answer.get("calls", {}).get(rollout_id, []))
            dropped += int(answer.get("dropped", {}).get(rollout_id, 0))
        calls.sort(key=lambda c: (c.get("started_at") or 0.0, c.get("call_index") or 0))
        return calls, dropped

    async def discard(self, rows: Iterable[dict[str, Any]], chunk: int = 5_000) -> int:
        """Drop whatever the model servers hold for ``rows``' rollout ids (calls of an earlier, interrupted
        run against the same servers), before those rows are sent again; returns how many were dropped."""
        ids = (maybe_rollout_id_from_run_body(r) for r in rows)
        batch: list[str] = []
        dropped = 0
        for rid in ids:
            if rid is not None:
                batch.append(rid)
            if len(batch) >= chunk:
                dropped += await self._discard_batch(batch)
                batch = []
        if batch:
            dropped += await self._discard_batch(batch)
        self.stale_discarded += dropped
        return dropped

    async def _discard_batch(self, rollout_ids: list[str]) -> int:
        from nemo_gym.errors import UpstreamError, response_body

        n = 0
        for server in self.servers:
            try:
                resp = await self.client.post(
                    server, POP_PATH, json={"rollout_ids": rollout_ids}, timeout_s=60
                )
                if resp.status == 200:
                    answer = orjson.loads(response_body(resp))
                    n += sum(len(v) for v in answer.get("calls", {}).values())
            except (UpstreamError, orjson.JSONDecodeError) as e:
                logger.warning("model-call capture: cannot clear earlier calls on %s: %s", server, e)
        return n

    async def write_rollout(self, row: dict[str, Any], status: str) -> None:
        """Pop ``row``'s calls and append them (scrubbed) to the file."""
        from nemo_gym.redaction import process_scrubber

        rollout_id = maybe_rollout_id_from_run_body(row)
        if rollout_id is None:
            return
        calls, dropped = await self.pop(rollout_id)
        keys = {
            "_ng_task_index": row.get("_ng_task_index"),
            "_ng_rollout_index": row.get("_ng_rollout_index"),
            "agent_ref": row.get("agent_ref"),
            "rollout_status": status,
        }
        scrubber = process_scrubber()
        if dropped:
            self.dropped += dropped
            self.writer.write(
                scrubber.scrub_obj(
                    {"kind": "dropped", **keys, "rollout_id": rollout_id, "dropped_calls": dropped}
                )
            )
        for call in calls:
            self.writer.write(scrubber.scrub_obj({"kind": "model_call", **keys, **call}))
        self.calls_written += len(calls)

    def summary(self, path: str) -> dict[str, Any]:
        return {
            "file": path,
            "calls_written": self.calls_written,
            "dropped": self.dropped,
            "pull_errors": self.pull_errors,
            "stale_discarded": self.stale_discarded,
        }

    def close(self) -> None:
        self.writer.close()
