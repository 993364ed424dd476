"""aviary_agent: the agent loop for Aviary resources servers (``resources_servers/aviary``).

Contract
--------
* ``POST /run`` takes a row ``{"task_idx": N, "responses_create_params": {...}}``: seeds the env
  (``/seed_session``), takes its tools and first observation, then repeats {model turn -> one
  ``/step`` with every function call of the turn} until the env says ``done``, ``max_steps`` model
  turns were made, or the model answers without a tool call (``done_if_no_tool_calls: true`` stops;
  ``false`` nudges it with ``no_tool_call_message``, still within ``max_steps``). Then ``/verify``
  gives the reward (the sum of the env's per-step rewards). Every call to the resources server carries
  the session cookie ``/seed_session`` set (the env is bound to that session).
* The env is always closed (bounded by ``close_timeout_s``), also when anything fails. When the caller
  of ``/run`` disconnects, the rollout is cancelled at once, whatever it is waiting on (the model, a
  step; :mod:`nemo_gym.server.disconnect`), and the env is closed with reason ``client_disconnected``.
* The response: ``output`` is the whole trajectory as Responses items (first observation, then per
  turn the model's items and the env's observations, in order), ``tools`` the env's tools, usage
  summed over turns, plus ``env_id``, ``group_id`` (the task index), ``contains_transitions``
  (false), ``stop_reason`` and ``steps``: per turn where its items are in ``output``, the
  observation, reward, done, and token ids when the model returned them.
* Bounded context (``collapse_old_env_states: true``, for long envs such as the notebook): the model
  sees the instruction, every earlier action and tool result, and only the *latest* environment-state
  observation; older ones are replaced by ``old_env_state_message``. Token-id fields are then not
  sent back to the model (its earlier prompts no longer prefix the new one). ``context_policy`` in
  the response records this, so :mod:`nemo_gym.tools.export_transitions` rebuilds each step's exact prompt.
* A failure to reach the model or the env server (or a 4xx/5xx from them) fails the rollout with a
  502/504 naming the server, never a reward. ``max_steps`` is required to be finite (upstream allowed
  unbounded loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.client.server_client import response_cookies
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.errors import UpstreamError, raise_for_status, response_body
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server.agent import USAGE_KEYS, add_usage
from nemo_gym.server.base import validated_body
from nemo_gym.server.disconnect import (
    cancel_reason,
)
from nemo_gym.tools.export_transitions import render_step_context

logger = logging.getLogger(__name__)


class AviaryAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    max_steps: int = Field(
        default=20, ge=1, description="Model turns per rollout (a bound, never unlimited)."
    )
    done_if_no_tool_calls: bool = Field(
        default=True, description="End the rollout when the model answers without a tool call (else nudge)."
    )
    no_tool_call_message: str = Field(
        default="You did not call a tool. To proceed, call at least one of the provided tools.",
    )
    collapse_old_env_states: bool = Field(
        default=False, description="Show the model only the latest environment-state observation."
    )
    old_env_state_message: str = Field(default="[Previous environment state - hidden]")
    max_total_sequence_length: int | None = Field(
        default=None,
        ge=1,
        description="Stop once a model turn's total tokens reach this (model context limit).",
    )
    close_timeout_s: float = Field(default=60.0, gt=0)
    send_row_to_seed_session: bool = Field(
        default=False,
        description="Send the whole task row to /seed_session (for servers whose rows carry the task, e.g. "
        "data_analysis_capsules), not only task_idx and responses_create_params.",
    )
    return_transitions: bool = Field(
        default=False,
        description="Upstream's nested per-transition output; not offered: the output stays one flat "
        "trajectory with per-step records, and ng_export_transitions writes one row per step.",
    )

    @field_validator("return_transitions")
    @classmethod
    def _no_nested_transitions(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "return_transitions: true (a list of transitions as the output) is not offered; the output is "
                "the flat trajectory with `steps` records: use ng_export_transitions for one row per step"
            )
        return value


class AviaryAgentRunRequest(BaseModel):
    """A task row of an Aviary environment."""

    model_config = ConfigDict(extra="allow")

    task_idx: int
    responses_create_params: NeMoGymResponseCreateParamsNonStreaming = Field(
        default_factory=lambda: NeMoGymResponseCreateParamsNonStreaming(input=[])
    )


def _token_fields(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn's token ids: the first prompt ids, generation ids and log-probs concatenated."""
    prompt: list[int] | None = None
    gen: list[int] = []
    logp: list[float] = []
    found = False
    for it in items:
        if it.get("generation_token_ids") is not None:
            found = True
            if prompt is None:
                prompt = it.get("prompt_token_ids")
            gen.extend(it.get("generation_token_ids") or [])
            logp.extend(it.get("generation_log_probs") or [])
    if not found:
        return {}
    return {"prompt_token_ids": prompt, "generation_token_ids": gen, "generation_log_probs": logp}


class AviaryAgent(SimpleResponsesAPIAgent):
    config: AviaryAgentConfig

    async def responses(self, request: Request) -> Response:
        """``/v1/responses`` needs a task (an env to step): use ``/run`` with a row."""
        return Response(
            orjson.dumps(
                {
                    "error": {
                        "kind": "unsupported",
                        "server": self.config.name,
                        "path": "/v1/responses",
                        "message": "aviary_agent runs Aviary tasks: POST /run with {task_idx, responses_create_params}",
                    }
                }
            ),
            status_code=400,
            media_type="application/json",
        )

    async def run(self, request: Request) -> Response:
        row = await validated_body(request, AviaryAgentRunRequest)
        row.setdefault("responses_create_params", {"input": []})
        return await self.answer_until_disconnected(request, self._rollout(row))

    async def _rollout(self, row: dict[str, Any]) -> dict[str, Any]:
        cookies: dict[str, str] = {}
        response = await self.run_episode(row, cookies=cookies)
        verify, _ = await self.server_client.post_json(
            self.config.resources_server.name,
            "/verify",
            json={**row, "response": response},
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        return verify

    async def _close(self, env_id: str, cookies: dict[str, str], reason: str | None = None) -> None:
        body: dict[str, Any] = {"env_id": env_id}
        if reason is not None:
            body["reason"] = reason
            logger.info("closing env %s: %s", env_id, reason)
        try:
            resp = await self.server_client.post(
                self.config.resources_server.name,
                "/close",
                json=body,
                cookies=cookies,
                timeout_s=self.config.close_timeout_s,
                timeout_setting=f"close_timeout_s of agent '{self.config.name}'",
            )
            if resp.status >= 400:
                logger.warning("closing env %s answered HTTP %s", env_id, resp.status)
        except UpstreamError as e:  # the server's idle reaper closes it eventually
            logger.warning("could not close env %s: %s", env_id, e)

    async def _seed(self, row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """``/seed_session`` (its answer and the session cookie it set); a 503 (every env slot busy) is
        retried with backoff until ``seed_session_timeout_s`` has passed, then fails the rollout."""
        resources = self.config.resources_server.name
        if self.config.send_row_to_seed_session:
            body = dict(row)
        else:
            body = {"task_idx": row["task_idx"], "responses_create_params": row["responses_create_params"]}
        deadline = time.monotonic() + self.config.seed_session_timeout_s
        delay = 0.02
        while True:
            left = deadline - time.monotonic()
            resp = await self.server_client.post(
                resources,
                "/seed_session",
                json=body,
                timeout_s=max(left, 0.001),
                timeout_setting=f"seed_session_timeout_s of agent '{self.config.name}'",
            )
            if resp.status != 503 or time.monotonic() + delay >= deadline:
                raise_for_status(resp, resources, "/seed_session")
                return orjson.loads(response_body(resp)), response_cookies(resp)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    async def run_episode(
        self, row: dict[str, Any], request: Request | None = None, cookies: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Seed, loop, close; the trajectory as an ``AviaryNeMoGymResponse`` dict. ``cookies`` (if given)
        receives the resources server's session cookie, for ``/verify``. ``request`` is not read
        (cancel the task to stop a rollout: :func:`nemo_gym.server.disconnect.run_until_disconnected`)."""
        cfg = self.config
        resources, model = cfg.resources_server.name, cfg.model_server.name
        cookies = {} if cookies is None else cookies
        seeding = asyncio.ensure_future(self._seed(row))
        try:
            seed, new_cookies = await asyncio.shield(seeding)
        except asyncio.CancelledError as e:
            # The server may make the env anyway: wait (bounded) for its answer, then close that env.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(cfg.close_timeout_s):
                    seed, new_cookies = await seeding
                    await self._close(seed["env_id"], new_cookies, cancel_reason(e))
            seeding.cancel()
            raise
        cookies.update(new_cookies)
        env_id: str = seed["env_id"]
        reason: str | None = None
        try:
            return await self._loop(row, seed, cookies, model, resources)
        except asyncio.CancelledError as e:
            reason = cancel_reason(e)
            raise
        finally:
            # Shielded: a cancelled rollout still closes its env (bounded by close_timeout_s).
            await asyncio.shield(self._close(env_id, cookies, reason))

    async def _loop(
        self, row: dict[str, Any], seed: dict[str, Any], cookies: dict[str, str], model: str, resources: str
    ) -> dict[str, Any]:
        cfg = self.config
        params = dict(row["responses_create_params"])
        raw_input = params.get("input") or []
        prefix = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else list(raw_input)
        tools = list(params.get("tools") or []) + list(seed.get("tools") or [])
        output: list[dict[str, Any]] = list(seed.get("obs") or [])
        steps: list[dict[str, Any]] = []
        usage = dict.fromkeys(USAGE_KEYS, 0)  # flat: this agent reports no detail counts
        response: dict[str, Any] = {}
        stop_reason = "max_steps"
        keep_ids = not cfg.collapse_old_env_states
        model_path = self.url_path_for_run("/v1/responses", row)  # /ng-rollout/<id> when capturing
        for step_no in range(1, cfg.max_steps + 1):
            model_input = render_step_context(
                prefix + output, cfg.collapse_old_env_states, cfg.old_env_state_message, keep_ids
            )
            body = {**params, "input": model_input, "tools": tools}
            response, _ = await self.server_client.post_json(
                model, model_path, json=body, **self.timeout("model_timeout_s")
            )
            turn = list(response.get("output") or [])
            add_usage(usage, response.get("usage"))
            start = len(output)
            output.extend(turn)
            action_end = len(output)
            record: dict[str, Any] = {"step": step_no, "output_start": start, "action_end": action_end}
            record.update(_token_fields(turn))
            calls = [it for it in turn if it.get("type") == "function_call"]
            if not calls:
                if cfg.done_if_no_tool_calls:
                    steps.append({**record, "output_end": action_end, "stepped_env": False})
                    stop_reason = "no_tool_call"
                    break
                output.append({"type": "message", "role": "user", "content": cfg.no_tool_call_message})
                steps.append({**record, "output_end": len(output), "stepped_env": False, "obs": [output[-1]]})
                continue
            result, _ = await self.server_client.post_json(
                resources,
                "/step",
                json={"env_id": seed["env_id"], "action": calls},
                cookies=cookies,
                **self.timeout("tool_timeout_s"),
            )
            obs = list(result.get("obs") or [])
            output.extend(obs)
            steps.append(
                {
                    **record,
                    "output_end": len(output),
                    "obs": obs,
                    "reward": result.get("reward", 0.0),
                    "done": bool(result.get("done")),
                    "truncated": bool(result.get("truncated")),
                    "reason": result.get("reason"),
                }
            )
            if result.get("done"):
                stop_reason = "done"
                break
            if response.get("status") == "incomplete":
                stop_reason = "incomplete"
                break
            total = int((response.get("usage") or {}).get("total_tokens") or 0)
            if cfg.max_total_sequence_length is not None and total >= cfg.max_total_sequence_length:
                stop_reason = "max_total_sequence_length"
                break
        # Model turns and tool calls of this episode (nemo_gym.server.metrics).
        self.observe_loop(len(steps), sum(1 for it in output if it.get("type") == "function_call"))
        return {
            **response,
            "output": output,
            "tools": tools,
            "usage": usage,
            "env_id": seed["env_id"],
            "group_id": str(row["task_idx"]),
            "contains_transitions": False,
            "stop_reason": stop_reason,
            "steps": steps,
            "context_policy": {
                "prefix_items": len(prefix),
                "collapse_old_env_states": cfg.collapse_old_env_states,
                "old_env_state_message": cfg.old_env_state_message,
                "token_ids_in_context": keep_ids,
            },
        }


if __name__ == "__main__":
    AviaryAgent.run_webserver()
