"""gymnasium_agent: drives a Gymnasium-style resources server (``/reset`` + ``/step``) with the policy model.

Contract
--------
* ``POST /run`` (a task row): ``/reset`` with the row (its observation is appended to the input as a
  user message) -> repeat {model turn -> ``/step`` with the row and that turn} until the server says
  ``terminated`` or ``truncated`` or ``max_steps`` model turns were made. After each step the server's
  ``info.tool_outputs`` become ``function_call_output`` items (also on the last step, so every call in
  the trajectory has its answer) and its ``observation`` a user message.
* The answer is the row laid over with ``response`` (the whole trajectory, usage summed),
  ``responses_create_params`` (with the first observation), ``reward`` = the sum of the step rewards
  (the episode return), ``terminated`` and ``truncated`` as the server reported them (kept apart),
  ``truncated_by_agent`` (``max_steps`` ran out first; then ``truncated`` is true too, as upstream),
  ``episode_steps`` (model turns), ``reason`` (how the episode ended, in words) and the last step's ``info``.
* When ``/reset``'s info says ``supports_explicit_close: true`` the agent calls ``/close`` after the
  episode, also when the rollout failed; a failing close after a good episode is recorded in
  ``info.cleanup_warning``. A failure to reach the model or the server fails the rollout (502/504
  naming the server and path), never a reward.
* When the caller of ``/run`` disconnects, the rollout is cancelled at once, whatever it waits on
  (:mod:`nemo_gym.server.disconnect`), and a closable episode is closed with body
  ``{"reason": "client_disconnected"}`` (bounded by ``tool_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.openai_utils import new_id
from nemo_gym.server.agent import add_usage, empty_usage
from nemo_gym.server.base import validated_body
from nemo_gym.server.disconnect import (
    cancel_reason,
)

_LOGGER = logging.getLogger(__name__)


class GymnasiumAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    max_steps: int = Field(default=10, ge=1)


class GymnasiumAgent(SimpleResponsesAPIAgent):
    config: GymnasiumAgentConfig

    async def responses(self, request: Request) -> Response:
        """One model turn, passed through (the episode needs a row: use /run)."""
        body = orjson.loads(await request.body())
        response, _ = await self.server_client.post_json(
            self.config.model_server.name,
            self.url_path_for_request("/v1/responses", request),
            json=body,
            cookies=dict(request.cookies),
            **self.timeout("model_timeout_s"),
        )
        return Response(orjson.dumps(response), media_type="application/json")

    async def run(self, request: Request) -> Response:
        row = await validated_body(request, BaseRunRequest)
        return await self.answer_until_disconnected(request, self._rollout(row, dict(request.cookies)))

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        env = self.config.resources_server.name
        reset, new_cookies = await self.server_client.post_json(
            env, "/reset", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        info = reset.get("info") or {}
        closable = info.get("supports_explicit_close") is True
        try:
            result = await self._episode(row, reset, cookies)
        except asyncio.CancelledError as e:
            if closable:  # shielded: the episode's state is dropped even though the rollout was cancelled
                await asyncio.shield(self._close_after_failure(cookies, cancel_reason(e)))
            raise
        except BaseException:
            if closable:
                try:
                    await self._close(cookies)
                except Exception:
                    _LOGGER.exception("closing the environment after a failed rollout failed")
            raise
        if closable:
            try:
                await self._close(cookies)
            except Exception as e:  # the episode itself is complete and scored
                result["info"] = {**result["info"], "cleanup_warning": f"{type(e).__name__}: {e}"}
        return {**row, **result}

    async def _close_after_failure(self, cookies: dict[str, str], reason: str) -> None:
        _LOGGER.info("closing the episode: %s", reason)
        try:
            await self._close(cookies, reason)
        except Exception:
            _LOGGER.exception("closing the environment after a cancelled rollout failed")

    async def _close(self, cookies: dict[str, str], reason: str | None = None) -> None:
        await self.server_client.post_json(
            self.config.resources_server.name,
            "/close",
            json={"reason": reason} if reason else {},
            cookies=cookies,
            **self.timeout("tool_timeout_s"),
        )

    async def _episode(
        self, row: dict[str, Any], reset: dict[str, Any], cookies: dict[str, str]
    ) -> dict[str, Any]:
        params = dict(row["responses_create_params"])
        raw_input = params.get("input", [])
        inputs = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else list(raw_input)
        if reset.get("observation"):
            inputs.append({"role": "user", "content": reset["observation"]})
        params["input"] = inputs
        model, env = self.config.model_server.name, self.config.resources_server.name
        outputs: list[dict[str, Any]] = []
        usage = empty_usage()
        response: dict[str, Any] = {}
        total, terminated, truncated, step_info, steps = 0.0, False, False, {}, 0
        model_path = self.url_path_for_run("/v1/responses", row)  # /ng-rollout/<id> when capturing
        for _ in range(self.config.max_steps):
            response, new_cookies = await self.server_client.post_json(
                model,
                model_path,
                json={**params, "input": inputs + outputs},
                cookies=cookies,
                **self.timeout("model_timeout_s"),
            )
            cookies.update(new_cookies)
            steps += 1
            turn = response.get("output") or []
            outputs.extend(turn)
            add_usage(usage, response.get("usage"))
            step, new_cookies = await self.server_client.post_json(
                env,
                "/step",
                json={**row, "response": response},
                cookies=cookies,
                **self.timeout("tool_timeout_s"),
            )
            cookies.update(new_cookies)
            total += float(step.get("reward") or 0.0)
            step_info = step.get("info") or {}
            for out in step_info.get("tool_outputs") or []:
                outputs.append(
                    {
                        "type": "function_call_output",
                        "id": new_id("fco"),
                        "call_id": out["call_id"],
                        "output": out["output"],
                        "status": "completed",
                    }
                )
            terminated, truncated = bool(step.get("terminated")), bool(step.get("truncated"))
            if terminated or truncated:
                break
            if step.get("observation"):
                outputs.append({"role": "user", "content": step["observation"], "type": "message"})
        truncated_by_agent = not (terminated or truncated)
        if terminated:
            reason = f"the episode reached a terminal state after {steps} model turns (return {total:g})"
        elif truncated:
            reason = f"the environment's step limit ended the episode (return {total:g})"
        else:
            reason = (
                f"max_steps ({self.config.max_steps}) model turns ran out before the episode ended "
                f"(return {total:g})"
            )
        # Model turns and tool calls of this episode (nemo_gym.server.metrics).
        self.observe_loop(steps, sum(1 for it in outputs if it.get("type") == "function_call"))
        return {
            "responses_create_params": params,
            "response": {**response, "output": outputs, "usage": usage},
            "reward": total,
            "terminated": terminated,
            "truncated": truncated or truncated_by_agent,
            "truncated_by_agent": truncated_by_agent,
            "episode_steps": steps,
            "reason": reason,
            "info": step_info,
        }


if __name__ == "__main__":
    GymnasiumAgent.run_webserver()
