"""simple_agent: the default agent loop.

seed the session with the task row -> repeat {model turn -> run its tool calls in order} until the
model answers without tool calls, the response is incomplete, or ``max_steps`` model turns were
made -> verify. Anything wrong with a tool call (unknown tool, arguments that are not JSON or fail
the tool's schema, a tool that raises) becomes a ``function_call_output`` the model reads; only a
failure to reach a server (or a model error) fails the rollout, as a 502 naming that server. When the
caller of ``/run`` or ``/v1/responses`` disconnects, the rollout stops at once, whatever it waits on
(:mod:`nemo_gym.server.disconnect`): no further model turn, tool call or verify is made for it.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.client.server_client import response_cookies
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.errors import UpstreamError, response_body
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, new_id
from nemo_gym.server.agent import add_usage, empty_usage
from nemo_gym.server.base import validated_body
from nemo_gym.server.disconnect import ClientDisconnected, disconnected_response, run_until_disconnected


class SimpleAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    # Model turns per rollout; a bound so a looping model cannot hang a rollout.
    max_steps: int = Field(default=20, ge=1)


class SimpleAgent(SimpleResponsesAPIAgent):
    config: SimpleAgentConfig

    async def responses(self, request: Request) -> Response:
        """Run the model/tool loop for one request (no seeding, no verify) and return the trajectory."""
        params = await validated_body(request, NeMoGymResponseCreateParamsNonStreaming)
        model_path = self.url_path_for_request("/v1/responses", request)
        try:
            response, _ = await run_until_disconnected(
                request, self.run_loop(params, dict(request.cookies), model_path)
            )
        except ClientDisconnected as e:
            return disconnected_response(self.config.name, e)
        return Response(orjson.dumps(response), media_type="application/json")

    async def run(self, request: Request) -> Response:
        """One rollout: seed the resources session with the row, loop, verify; return the verify response
        laid over the row.

        The row is checked against ``BaseRunRequest`` (unknown ``responses_create_params`` keys are a
        422 naming them) and forwarded exactly as received; the verifier reads the fields it declares
        and answers those plus ``reward``. The result is the row updated with the verify response, so
        task fields the verifier does not declare (ids, metadata) still reach the output, and stale
        values a re-run row carries (an old ``reward``) are replaced by the verifier's.
        """
        row = await validated_body(request, BaseRunRequest)
        # A caller that goes away stops the rollout at once: no more model turns, tools or verify.
        return await self.answer_until_disconnected(request, self._rollout(row, dict(request.cookies)))

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        """Seed, loop, verify; the verify response laid over the row."""
        # Cookies are named per server instance, so one dict serves every server of this rollout.
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        # With observability_enabled the model calls carry /ng-rollout/<id> (nemo_gym.server.model_calls).
        model_path = self.url_path_for_run("/v1/responses", row)
        response, cookies = await self.run_loop(row["responses_create_params"], cookies, model_path)
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json={**row, "response": response},
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        return {**row, **verify}

    # ------------------------------------------------------------------------------------------------
    async def run_loop(
        self, params: dict[str, Any], cookies: dict[str, str], model_path: str = "/v1/responses"
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Model/tool loop; returns the whole trajectory as one response dict (usage summed over turns)
        and the rollout's cookies (``cookies`` updated in place with any the servers set). Model turns
        are posted to ``model_path`` (``/v1/responses``, with the rollout's prefix when capturing)."""
        model = self.config.model_server.name
        raw_input = params.get("input", [])
        input_items = (
            [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else list(raw_input)
        )
        tool_names = [
            t.get("name") for t in params.get("tools") or [] if t.get("type", "function") == "function"
        ]
        outputs: list[dict[str, Any]] = []
        usage = empty_usage()
        response: dict[str, Any] = {}
        turns = tool_calls = 0
        for _step in range(self.config.max_steps):
            turns += 1
            request_body = {**params, "input": input_items + outputs}
            response, new_cookies = await self.server_client.post_json(
                model, model_path, json=request_body, cookies=cookies, **self.timeout("model_timeout_s")
            )
            cookies.update(new_cookies)
            turn_output = response.get("output") or []
            outputs.extend(turn_output)
            add_usage(usage, response.get("usage"))
            calls = [item for item in turn_output if item.get("type") == "function_call"]
            if not calls or response.get("status") == "incomplete":
                break
            tool_calls += len(calls)
            for call in calls:  # in the order the model made them
                text = await self.call_tool(call, tool_names, cookies)
                outputs.append(
                    {
                        "type": "function_call_output",
                        "id": new_id("fco"),
                        "call_id": call.get("call_id", ""),
                        "output": text,
                        "status": "completed",
                    }
                )
        self.observe_loop(turns, tool_calls)  # nemo_gym.server.metrics
        return {**response, "output": outputs, "usage": usage}, cookies

    async def call_tool(self, call: dict[str, Any], tool_names: list[str], cookies: dict[str, str]) -> str:
        """Run one tool call; every way it can go wrong on the model's side becomes text for the model.

        Only the resources server failing as infrastructure (unreachable, timeout, a 5xx that is not a
        tool raising) raises :class:`UpstreamError`, which fails the rollout with a 502.
        """
        name = call.get("name", "")
        if name not in tool_names:
            return f"Error: unknown tool {name!r}. Available tools: {', '.join(tool_names) or 'none'}."
        try:
            args = orjson.loads(call.get("arguments") or "{}")
        except orjson.JSONDecodeError as e:
            return f"Error: the arguments for tool {name!r} are not valid JSON ({e}). Send a JSON object."
        if not isinstance(args, dict):
            return f"Error: the arguments for tool {name!r} must be a JSON object, got {type(args).__name__}."
        resources = self.config.resources_server.name
        resp = await self.server_client.post(
            resources, f"/{name}", json=args, cookies=cookies, **self.timeout("tool_timeout_s")
        )
        cookies.update(response_cookies(resp))
        body = response_body(resp)
        if resp.status < 400:
            return body.decode(errors="replace")
        try:
            detail = orjson.loads(body)
        except orjson.JSONDecodeError:
            detail = {}
        error = detail.get("error", {}) if isinstance(detail, dict) else {}
        error = error if isinstance(error, dict) else {}
        if resp.status == 422:
            return f"Error: invalid arguments for tool {name!r}: {error.get('message') or detail}"
        if resp.status == 404:
            return f"Error: tool {name!r} is not served by the resources server."
        if resp.status == 500 and error.get("kind") == "internal_error":
            return f"Error: tool {name!r} failed: {error.get('type')}: {error.get('message')}"
        if resp.status < 500:
            # A tool refusing its input on purpose (e.g. HTTPException(400, ...)): the model should read why.
            message = (
                detail.get("detail")
                if isinstance(detail, dict) and "detail" in detail
                else body.decode(errors="replace")
            )
            return f"Error: tool {name!r} answered HTTP {resp.status}: {message}"
        # Anything else (502/503/504, ...) is the infrastructure failing, not the model's doing.
        raise UpstreamError(resources, f"/{name}", resp.status, detail or body.decode(errors="replace"))


if __name__ == "__main__":
    SimpleAgent.run_webserver()
