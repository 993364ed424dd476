"""A NeMo Gym resources server over any Aviary environment (``aviary.core.Environment``).

Contract
--------
* ``AviaryResourcesServer[EnvT, DatasetT]``: a subclass names its environment and dataset types and
  sets ``dataset: DatasetT = Field(default_factory=...)`` (the factory may take the validated fields,
  ``lambda data: MyDataset.from_config(data["config"])``). ``gsm8k_app.py``, ``hotpotqa_app.py`` and
  ``notebook_app.py`` are such subclasses.
* A task row is ``{"task_idx": N, "responses_create_params": {"input": []}}``.
  ``POST /seed_session {task_idx}`` builds the env for that task, resets it and answers
  ``{env_id, obs, tools}`` (tools as Responses function tools). ``POST /step {env_id, action}``
  steps the env once with every function call of a model turn and answers ``{obs, reward, done,
  truncated, step}``: a ``function_call_output`` per call (Aviary's tool responses) plus any other
  observation messages. ``POST /verify`` answers the rollout's total reward (the sum of the env's
  per-step rewards, which may be negative) with ``step_rewards``. ``POST /close {env_id}`` closes it.
* Bounds: at most ``max_live_envs`` envs live at once (``/seed_session`` waits up to
  ``seed_wait_timeout_s`` for a slot, then answers 503); an env untouched for ``idle_timeout_s`` is
  closed by a reaper; reset/step/close are bounded by their timeouts; every live env is closed when
  the server stops. ``GET /env_stats`` reports live/peak counts.
* One answer per turn: the calls of a turn after its first call of an answer tool (``answer_tools``,
  default ``submit_answer``) are not run, and say so (Aviary would run and reward every one of them).
  ``/verify`` adds ``failure_reason`` when the reward is not positive.
* Errors: a ``task_idx`` outside the dataset is a 422 naming the range; an unknown ``env_id`` is a
  404, a closed one a 409 saying why it closed; a malformed body a 422. A call whose ``arguments`` are
  not a JSON object (or nest past the JSON decoder's depth), and an env raising inside ``step()``,
  become ``function_call_output`` error text the model reads (the env stays usable). A step that
  exceeds ``step_timeout_s`` ends the episode with an error output. ``/verify`` for an env this server
  never saw (or forgot) is a 404, never reward 0.
* Upstream's server kept a total-reward entry per env forever; here finished envs are kept in a
  bounded record (``max_finished_records``).
* A subclass whose env construction and ``reset()`` do only CPU work sets ``RESET_OFF_LOOP = True``
  (GSM8K, HotPotQA): both then run on one worker thread (with its own event loop for the ``reset()``
  coroutine), not on the server's event loop, where they would stall every other request. Aviary's
  ``CalculatorEnv`` and ``HotPotQAEnv`` build their tools with ``Tool.from_function`` (pydantic models
  and JSON schemas) for every episode: ~7 ms on GSM8K. An env whose ``reset()`` binds loop resources
  (the notebook's Jupyter kernel client) keeps the default, ``False``.
"""

from __future__ import annotations

import os

# Aviary imports LiteLLM, which fetches a price list over the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from abc import ABC  # noqa: E402
from collections import OrderedDict  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, ClassVar, Generic, TypeVar  # noqa: E402

from fastapi import FastAPI, HTTPException, Request  # noqa: E402
from pydantic import ConfigDict, PrivateAttr  # noqa: E402

from aviary.core import (  # noqa: E402
    Environment,
    Message,
    TaskDataset,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolRequestMessage,
    ToolResponseMessage,
)
from nemo_gym.base_resources_server import SimpleResourcesServer  # noqa: E402
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.server.base import get_session_id
from nemo_gym.server.disconnect import CLIENT_DISCONNECTED  # noqa: E402
from resources_servers.aviary.schemas import (  # noqa: E402
    ENV_STATE_KEY,
    AviaryAgentVerifyRequest,
    AviaryAgentVerifyResponse,
    AviaryCloseRequest,
    AviaryCloseResponse,
    AviaryResourcesServerConfig,
    AviarySeedSessionRequest,
    AviarySeedSessionResponse,
    AviaryStepRequest,
    AviaryStepResponse,
)

logger = logging.getLogger(__name__)

EnvT = TypeVar("EnvT", bound=Environment)
DatasetT = TypeVar("DatasetT", bound=TaskDataset)
# Upstream's names for the type variables.
TEnv = EnvT
TDataset = DatasetT

DATA_DIR = Path(__file__).resolve().parent / "data"


def resolve_data_path(path: str | None, default_name: str) -> Path:
    """The dataset file: ``path`` relative to the working directory (else to the repository), or the
    server's default file in ``data/``. A missing file is a ``FileNotFoundError`` naming both tries."""
    if path is None:
        return DATA_DIR / default_name
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"dataset file not found: {p}")
        return p
    alt = PACKAGE_PARENT_DIR / p
    if alt.exists():
        return alt
    raise FileNotFoundError(
        f"dataset file not found: {path} (looked in {Path.cwd()} and {PACKAGE_PARENT_DIR})"
    )


# ------------------------------------------------------------------------------------------------
# Aviary <-> Responses conversions.


def tool_to_function_tool_param(tool: Tool) -> dict[str, Any]:
    """An Aviary tool as a Responses API function tool (strict only when every parameter is required)."""
    info = tool.info.model_dump(mode="json", exclude_none=True)
    params = dict(info.get("parameters") or {"type": "object", "properties": {}})
    params.setdefault("additionalProperties", False)
    props = params.get("properties") or {}
    strict = set(params.get("required") or []) == set(props)
    out: dict[str, Any] = {"type": "function", "name": info["name"], "parameters": params, "strict": strict}
    if info.get("description"):
        out["description"] = info["description"]
    return out


def _message_text(msg: Message) -> str:
    """The text of an Aviary message; multimodal content (a JSON list of parts) keeps its text parts."""
    content = msg.content
    if content is None:
        return ""
    if getattr(msg, "content_is_json_str", False) or (content.startswith("[") and content.endswith("]")):
        try:
            parts = json.loads(content)
        except json.JSONDecodeError:
            return content
        if isinstance(parts, list) and all(isinstance(p, dict) for p in parts):
            texts = [p.get("text", "") for p in parts if p.get("type") == "text"]
            dropped = len(parts) - len(texts)
            text = "\n".join(texts)
            return text + (f"\n[{dropped} non-text part(s) not shown]" if dropped else "")
    return content


def obs_to_items(obs: list[Message]) -> list[dict[str, Any]]:
    """Aviary observations as Responses input items: tool responses become ``function_call_output``;
    other messages become messages (role user unless system), env-state ones marked ``is_env_state``."""
    items: list[dict[str, Any]] = []
    for msg in obs:
        if isinstance(msg, ToolResponseMessage):
            items.append(
                {"type": "function_call_output", "call_id": msg.tool_call_id, "output": _message_text(msg)}
            )
            continue
        role = "system" if msg.role == "system" else "user"
        item: dict[str, Any] = {"type": "message", "role": role, "content": _message_text(msg)}
        if (msg.info or {}).get(ENV_STATE_KEY):
            item[ENV_STATE_KEY] = True
        items.append(item)
    return items


def _error_outputs(calls: list[Any], message: str) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": c.call_id, "output": message} for c in calls]


# ------------------------------------------------------------------------------------------------
# Env construction and reset off the event loop.

_reset_thread_state = threading.local()


def _run_coroutine_here(coro: Any) -> Any:
    """Run ``coro`` to completion on this (worker) thread's own event loop, made once per thread."""
    runner = getattr(_reset_thread_state, "runner", None)
    if runner is None:
        runner = _reset_thread_state.runner = asyncio.Runner()
    return runner.run(coro)


def _close_thread_runner() -> None:
    runner = getattr(_reset_thread_state, "runner", None)
    if runner is not None:
        runner.close()
        _reset_thread_state.runner = None


# ------------------------------------------------------------------------------------------------
# Live envs.


def _failure_reason(reward: float, rewards: list[float], done: bool) -> str | None:
    """Why a rollout earned nothing, in words (None when it earned a reward)."""
    if reward > 0:
        return None
    if not done:
        return (
            f"the episode did not end (no answer submitted) after {len(rewards)} env steps: rewards {rewards}"
        )
    return f"the episode ended with the env's rewards {rewards} (sum {reward:g})"


@dataclass
class _LiveEnv:
    env: Environment
    task_idx: int
    session_id: str
    tool_names: list[str]
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    step_rewards: list[float] = field(default_factory=list)
    done: bool = False


@dataclass
class _Finished:
    task_idx: int
    session_id: str
    step_rewards: list[float]
    done: bool
    reason: str
    info: dict[str, Any] = field(default_factory=dict)  # env_info() of the env when it closed


class AviaryResourcesServer(SimpleResourcesServer, Generic[EnvT, DatasetT], ABC):
    """Serves the envs of ``dataset`` (see the module docstring)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config: AviaryResourcesServerConfig
    dataset: DatasetT

    # Construct and reset envs on a worker thread (see the module docstring); only for envs whose
    # construction and reset() need nothing of the server's event loop.
    RESET_OFF_LOOP: ClassVar[bool] = False

    _live: dict[str, _LiveEnv] = PrivateAttr(default_factory=dict)
    _finished: OrderedDict[str, _Finished] = PrivateAttr(default_factory=OrderedDict)
    _slots: asyncio.Semaphore | None = PrivateAttr(default=None)
    _reaper: asyncio.Task | None = PrivateAttr(default=None)
    # One thread: resets are CPU work that holds the GIL, so more threads would only take turns with
    # the event loop's thread more often (each may hold the GIL for a switch interval, 5 ms).
    _reset_pool: ThreadPoolExecutor | None = PrivateAttr(default=None)
    _abandoned_closes: set[asyncio.Task] = PrivateAttr(default_factory=set)
    _stats: dict[str, int] = PrivateAttr(
        default_factory=lambda: {
            "seeded": 0,
            "closed": 0,
            "closed_idle": 0,
            "peak_live": 0,
            "seed_rejected": 0,
            "closed_client_disconnected": 0,
        }
    )

    # -- app -----------------------------------------------------------------------------------------
    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/step")(self.step)
        app.post("/close")(self.close)
        app.get("/env_stats")(self.env_stats)
        return app

    def _slots_sem(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_live_envs)
        return self._slots

    async def on_startup(self) -> None:
        await super().on_startup()
        self._slots_sem()
        self._reaper = asyncio.create_task(self._reap_idle_forever())

    async def on_shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(
            *(self._close_env(env_id, "server shutdown") for env_id in list(self._live)),
            return_exceptions=True,
        )
        if self._reset_pool is not None:
            pool, self._reset_pool = self._reset_pool, None
            pool.submit(_close_thread_runner)
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=False)
        await super().on_shutdown()

    # -- endpoints -----------------------------------------------------------------------------------
    async def seed_session(
        self, request: Request, body: AviarySeedSessionRequest
    ) -> AviarySeedSessionResponse:
        """Make and reset the env for ``task_idx`` (waits, bounded, for a free slot); the env belongs to
        the session of this request (its cookie)."""
        self.check_seed_request(body)
        slots = self._slots_sem()
        try:
            await asyncio.wait_for(slots.acquire(), timeout=self.config.seed_wait_timeout_s)
        except TimeoutError:
            self._stats["seed_rejected"] += 1
            cap, waited = self.config.max_live_envs, self.config.seed_wait_timeout_s
            raise HTTPException(
                503,
                f"all {cap} env slots are in use (max_live_envs={cap}) and none came free within "
                f"{waited:g} s (seed_wait_timeout_s): retry later, close envs that are done (/close), "
                "or raise max_live_envs",
                headers={"Retry-After": str(max(1, math.ceil(waited)))},
            ) from None
        try:
            env, obs, tools = await self._new_env(body.task_idx, body)
        except BaseException:
            slots.release()
            raise
        env_id = str(uuid.uuid4())
        self._live[env_id] = _LiveEnv(
            env=env,
            task_idx=body.task_idx,
            session_id=get_session_id(request),
            tool_names=[t.info.name for t in tools],
            last_used=time.monotonic(),
        )
        self._stats["seeded"] += 1
        self._stats["peak_live"] = max(self._stats["peak_live"], len(self._live))
        return AviarySeedSessionResponse(
            env_id=env_id, obs=obs_to_items(obs), tools=[tool_to_function_tool_param(t) for t in tools]
        )

    async def step(self, request: Request, body: AviaryStepRequest) -> AviaryStepResponse:
        """Step the env once with every call of the turn."""
        live = self._get_live(body.env_id, request)
        async with live.lock:
            if body.env_id not in self._live:  # closed while this request waited
                self._get_live(body.env_id, request)
            live.last_used = time.monotonic()
            if live.done:
                raise HTTPException(409, f"env_id {body.env_id!r} is done; close it")
            calls: list[ToolCall] = []
            bad: list[str] = []
            for call in body.action:
                try:
                    args = json.loads(call.arguments or "{}")
                except json.JSONDecodeError as e:
                    bad.append(f"the arguments of {call.name!r} are not valid JSON ({e})")
                    continue
                except RecursionError:
                    bad.append(f"the arguments of {call.name!r} nest deeper than a JSON decoder follows")
                    continue
                if not isinstance(args, dict):
                    bad.append(
                        f"the arguments of {call.name!r} must be a JSON object, got {type(args).__name__}"
                    )
                    continue
                calls.append(
                    ToolCall(id=call.call_id, function=ToolCallFunction(name=call.name, arguments=args))
                )
            step_no = len(live.step_rewards) + 1
            calls, not_run = self._stop_at_answer(calls)
            if bad:
                # Aviary cannot take calls it cannot parse: nothing is run, the model reads why.
                msg = (
                    "Error: " + "; ".join(bad) + ". No call of this turn was run; send JSON object arguments."
                )
                live.step_rewards.append(0.0)
                return AviaryStepResponse(
                    obs=_error_outputs(body.action, msg), reward=0.0, done=False, step=step_no
                )
            try:
                async with asyncio.timeout(self.config.step_timeout_s):
                    obs, reward, done, truncated = await live.env.step(ToolRequestMessage(tool_calls=calls))
            except TimeoutError:
                live.step_rewards.append(0.0)
                live.done = True
                msg = (
                    f"Error: the environment did not finish this step within {self.config.step_timeout_s:g} s"
                )
                return AviaryStepResponse(
                    obs=_error_outputs(body.action, msg), reward=0.0, done=True, step=step_no
                )
            except HTTPException:
                # An env that answers over HTTP (remote_app.py) reports its infrastructure failures so:
                # the rollout fails with that status, never a tool error or a reward.
                raise
            except Exception as e:  # the env raising mid-step: a tool error the model reads
                logger.warning("env %s step raised %s: %s", body.env_id, type(e).__name__, e)
                live.step_rewards.append(0.0)
                msg = f"Error: {type(e).__name__}: {e}"
                return AviaryStepResponse(
                    obs=_error_outputs(body.action, msg), reward=0.0, done=False, step=step_no
                )
            live.last_used = time.monotonic()
            reward = float(reward)
            live.step_rewards.append(reward)
            live.done = bool(done)
            items = obs_to_items(obs)
            skipped = self._not_run_outputs(not_run, calls[-1].function.name if not_run else "")
            items.extend(skipped)
            reason = self._unanswered_calls(live, body.action, items, reward, bool(done))
            if skipped:
                reason = "\n".join(filter(None, [reason, skipped[0]["output"]]))
            return AviaryStepResponse(
                obs=items,
                reward=reward,
                done=bool(done),
                truncated=bool(truncated),
                step=step_no,
                reason=reason,
            )

    async def verify(self, request: Request, body: AviaryAgentVerifyRequest) -> AviaryAgentVerifyResponse:
        """The rollout's reward: the sum of the env's per-step rewards."""
        env_id = body.response.env_id
        record: _LiveEnv | _Finished | None = self._live.get(env_id) or self._finished.get(env_id)
        if record is None:
            raise HTTPException(
                404,
                f"env_id {env_id!r} is unknown to this server (never seeded here, or its record was dropped: "
                f"max_finished_records={self.config.max_finished_records})",
            )
        self._check_owner(env_id, record, request)
        if record.task_idx != body.task_idx:
            raise HTTPException(
                422, f"env_id {env_id!r} ran task_idx {record.task_idx}, but the row says {body.task_idx}"
            )
        rewards = list(record.step_rewards)
        reward = float(sum(rewards))
        return AviaryAgentVerifyResponse.from_request(
            body,
            reward=reward,
            step_rewards=rewards,
            num_steps=len(rewards),
            env_done=record.done,
            failure_reason=_failure_reason(reward, rewards, record.done),
        )

    async def close(self, request: Request, body: AviaryCloseRequest) -> AviaryCloseResponse:
        """Close and forget ``env_id`` (closing a closed env again is a success). ``reason`` (optional)
        says why; ``client_disconnected`` is counted in ``/env_stats``."""
        finished = self._finished.get(body.env_id)
        if finished is not None and body.env_id not in self._live:
            self._check_owner(body.env_id, finished, request)
            return AviaryCloseResponse(message=f"already closed ({finished.reason})", success=True)
        live = self._live.get(body.env_id)
        if live is None:
            raise HTTPException(404, f"unknown env_id {body.env_id!r}")
        self._check_owner(body.env_id, live, request)
        if body.reason == CLIENT_DISCONNECTED:
            self._stats["closed_client_disconnected"] += 1
        reason = f"closed by client: {body.reason}" if body.reason else "closed by client"
        error = await self._close_env(body.env_id, reason)
        if error:
            return AviaryCloseResponse(message=error, success=False)
        return AviaryCloseResponse(message="Success", success=True)

    def _stop_at_answer(self, calls: list[ToolCall]) -> tuple[list[ToolCall], list[ToolCall]]:
        """The calls of a turn up to and including its first answer call (``answer_tools``), and the
        calls after it, which are not run: an answer ends the episode, and Aviary would otherwise run
        (and reward) every answer of the turn, so a policy could submit several answers at once."""
        for i, call in enumerate(calls):
            if call.function.name in self.config.answer_tools:
                return calls[: i + 1], calls[i + 1 :]
        return calls, []

    @staticmethod
    def _not_run_outputs(calls: list[ToolCall], answer_tool: str) -> list[dict[str, Any]]:
        message = (
            f"Error: the episode has already ended ({answer_tool!r} answered the task earlier in this turn); "
            "this call was not run."
        )
        return [{"type": "function_call_output", "call_id": c.id, "output": message} for c in calls]

    # -- hooks for subclasses --------------------------------------------------------------------------
    def check_seed_request(self, body: AviarySeedSessionRequest) -> None:
        """Refuse a seed request the server cannot serve (``HTTPException``): here, a ``task_idx``
        outside the dataset (422 naming the range)."""
        n = len(self.dataset)
        if not 0 <= body.task_idx < n:
            raise HTTPException(
                422, f"task_idx {body.task_idx} is out of range: this dataset has {n} tasks (0..{n - 1})"
            )

    def new_env(self, task_idx: int, body: AviarySeedSessionRequest | None = None) -> Environment:
        """The env of a seed request, not yet reset: the dataset's task ``task_idx``. A server whose rows
        carry the task itself (data_analysis_capsules) builds it from ``body`` instead."""
        return self.dataset.get_new_env_by_idx(task_idx)

    def env_info(self, env: Environment) -> dict[str, Any]:
        """What ``/verify`` may report of an env beyond its rewards, read when the env closes (kept
        with its finished record): nothing here; a subclass returns its metrics."""
        return {}

    def record_info(self, env_id: str) -> dict[str, Any]:
        """``env_info`` of a live env, or what was kept when it closed ({} when unknown)."""
        live = self._live.get(env_id)
        if live is not None:
            return self.env_info(live.env)
        finished = self._finished.get(env_id)
        return dict(finished.info) if finished is not None else {}

    async def env_stats(self) -> dict[str, Any]:
        """``GET /env_stats``: live and peak env counts and totals (for tests and operators)."""
        return {
            "live": len(self._live),
            "max_live_envs": self.config.max_live_envs,
            "finished_records": len(self._finished),
            **self._stats,
        }

    # -- internals -----------------------------------------------------------------------------------
    def _get_live(self, env_id: str, request: Request) -> _LiveEnv:
        live = self._live.get(env_id)
        if live is not None:
            self._check_owner(env_id, live, request)
            return live
        done = self._finished.get(env_id)
        if done is not None:
            self._check_owner(env_id, done, request)
            raise HTTPException(409, f"env_id {env_id!r} is closed ({done.reason})")
        raise HTTPException(404, f"unknown env_id {env_id!r} (seed a session first)")

    def _check_owner(self, env_id: str, record: _LiveEnv | _Finished, request: Request) -> None:
        """Only the session that seeded an env may step, verify or close it (403 otherwise)."""
        if record.session_id != get_session_id(request):
            raise HTTPException(
                403,
                f"env_id {env_id!r} belongs to another session: only the session that seeded it may use it. "
                f"Send the session cookie ({cookie_name_for(self.config.name)!r}) that /seed_session set "
                "with every /step, /verify and /close of that env.",
            )

    def _unanswered_calls(
        self,
        live: _LiveEnv,
        calls: list[Any],
        items: list[dict[str, Any]],
        reward: float,
        done: bool,
    ) -> str | None:
        """Make every call the env did not really answer say why, in its ``function_call_output``
        (added to ``items`` when missing). Aviary answers a call of an unknown tool with an empty
        response (GSM8K also ends the episode at ``tool_failure_reward``); the reward stays Aviary's,
        the text names the tool and the env's tools. The same text is the step's ``reason`` (None when
        every call got a real answer)."""
        outputs = {it.get("call_id"): it for it in items if it.get("type") == "function_call_output"}
        names = [t.info.name for t in getattr(live.env, "tools", None) or []] or live.tool_names
        texts: list[str] = []
        for call in calls:
            item = outputs.get(call.call_id)
            if call.name in names:
                if item is not None:
                    continue
                why = f"Error: the environment gave no answer to this call of {call.name!r}"
            elif item is not None and str(item.get("output") or "").strip():
                continue  # the env explained it itself
            else:
                why = (
                    f"Error: {call.name!r} is not a tool of this environment (its tools: {', '.join(names)})"
                )
            if done:
                why += f"; the environment ended the episode with reward {reward:g}"
            if item is None:
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": why})
            else:
                item["output"] = why
            texts.append(why)
        return "\n".join(texts) or None

    async def _new_env(
        self, task_idx: int, body: AviarySeedSessionRequest | None = None
    ) -> tuple[Environment, list[Message], list[Tool]]:
        """Construct and reset the env of ``task_idx`` (on the worker thread with ``RESET_OFF_LOOP``),
        bounded by ``reset_timeout_s``; an env whose reset fails is closed before the error is raised."""
        if not self.RESET_OFF_LOOP:
            env = self.new_env(task_idx, body)
            try:
                async with asyncio.timeout(self.config.reset_timeout_s):
                    obs, tools = await env.reset()
            except BaseException:
                await self._safe_close(env, "reset failed")
                raise
            return env, obs, tools
        if self._reset_pool is None:
            self._reset_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aviary-reset")
        made = asyncio.get_running_loop().run_in_executor(
            self._reset_pool, self._make_and_reset, task_idx, body
        )
        try:
            async with asyncio.timeout(self.config.reset_timeout_s):
                env, outcome = await asyncio.shield(made)
        except BaseException:
            # Timed out or cancelled (or construction raised): the thread may still finish; close its env.
            made.add_done_callback(self._close_abandoned)
            raise
        if isinstance(outcome, BaseException):
            await self._safe_close(env, "reset failed")
            raise outcome
        obs, tools = outcome
        return env, obs, tools

    def _make_and_reset(
        self, task_idx: int, body: AviarySeedSessionRequest | None = None
    ) -> tuple[Environment, Any]:
        """On the worker thread: the new env and ``reset()``'s answer, or the exception it raised."""
        env = self.new_env(task_idx, body)
        try:
            return env, _run_coroutine_here(env.reset())
        except Exception as e:  # noqa: BLE001 - raised on the event loop, after the env is closed
            return env, e

    def _close_abandoned(self, made: asyncio.Future) -> None:
        if made.cancelled() or made.exception() is not None:
            return
        env, _ = made.result()
        task = asyncio.get_running_loop().create_task(self._safe_close(env, "reset abandoned"))
        self._abandoned_closes.add(task)
        task.add_done_callback(self._abandoned_closes.discard)

    async def _safe_close(self, env: Environment, why: str) -> str | None:
        try:
            async with asyncio.timeout(self.config.close_timeout_s):
                await env.close()
        except BaseException as e:  # noqa: BLE001 - a close failing must not leak the slot
            logger.warning("closing an env (%s) failed: %s: %s", why, type(e).__name__, e)
            return f"{type(e).__name__}: {e}"
        return None

    async def _close_env(self, env_id: str, reason: str) -> str | None:
        live = self._live.pop(env_id, None)
        if live is None:
            return None
        try:
            try:
                info = self.env_info(live.env)
            except Exception as e:  # noqa: BLE001 - the close must go on; verify reports no metrics
                logger.warning("env_info of env %s failed: %s: %s", env_id, type(e).__name__, e)
                info = {}
            self._finished[env_id] = _Finished(
                live.task_idx, live.session_id, live.step_rewards, live.done, reason, info
            )
            while len(self._finished) > self.config.max_finished_records:
                self._finished.popitem(last=False)
            return await self._safe_close(live.env, reason)
        finally:
            self._slots_sem().release()
            self._stats["closed"] += 1

    async def _reap_idle_forever(self) -> None:
        period = max(0.05, min(self.config.idle_timeout_s / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            idle = [
                env_id
                for env_id, live in list(self._live.items())
                if now - live.last_used > self.config.idle_timeout_s and not live.lock.locked()
            ]
            for env_id in idle:
                self._stats["closed_idle"] += 1
                await self._close_env(env_id, f"idle for more than {self.config.idle_timeout_s:g} s")
