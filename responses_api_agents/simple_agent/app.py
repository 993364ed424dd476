"""simple_agent: the default agent loop.

seed the session with the task row -> repeat {model turn -> run its tool calls in order} until the
model answers without tool calls, the response is incomplete, or ``max_steps`` model turns were
made -> verify. Anything wrong with a tool call (unknown tool, arguments that are not JSON or fail
the tool's schema, a tool that raises) becomes a ``function_call_output`` the model reads; only a
failure to reach a server (or a model error) fails the rollout, as a 502 naming that server.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, dump
from nemo_gym.server_utils import UpstreamError, response_body, response_cookies


class SimpleAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    max_steps: int = 20  # model turns per rollout; a bound so a looping model cannot hang a rollout


class SimpleAgent(SimpleResponsesAPIAgent):
    config: SimpleAgentConfig

    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        response, _ = await self.run_loop(dump(body), dict(request.cookies))
        return Response(orjson.dumps(response), media_type="application/json")

    async def run(self, request: Request, body: BaseRunRequest) -> Response:
        row = dump(body)
        cookies = dict(request.cookies)
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(resources, "/seed_session", json=row, cookies=cookies)
        cookies.update(new_cookies)
        response, cookies = await self.run_loop(row["responses_create_params"], cookies)
        verify, _ = await self.server_client.post_json(
            resources, "/verify", json={**row, "response": response}, cookies=cookies
        )
        return Response(orjson.dumps(verify), media_type="application/json")

    # ------------------------------------------------------------------------------------------------
    async def run_loop(self, params: dict[str, Any], cookies: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        """Model/tool loop; returns the whole trajectory as one response dict."""
        model = self.config.model_server.name
        raw_input = params.get("input", [])
        input_items = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else list(raw_input)
        tool_names = [t.get("name") for t in params.get("tools") or [] if t.get("type", "function") == "function"]
        outputs: list[dict[str, Any]] = []
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        response: dict[str, Any] = {}
        for _step in range(self.config.max_steps):
            request_body = {**params, "input": input_items + outputs}
            response, new_cookies = await self.server_client.post_json(
                model, "/v1/responses", json=request_body, cookies=cookies
            )
            cookies.update(new_cookies)
            turn_output = response.get("output") or []
            outputs.extend(turn_output)
            for key in usage:
                usage[key] += int((response.get("usage") or {}).get(key) or 0)
            calls = [item for item in turn_output if item.get("type") == "function_call"]
            if not calls or response.get("status") == "incomplete":
                break
            for call in calls:
                text = await self.call_tool(call, tool_names, cookies)
                outputs.append({"type": "function_call_output", "call_id": call.get("call_id", ""), "output": text})
        response = {**response, "output": outputs, "usage": usage}
        return response, cookies

    async def call_tool(self, call: dict[str, Any], tool_names: list[str], cookies: dict[str, str]) -> str:
        """Run one tool call; every way it can go wrong becomes text for the model."""
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
        resp = await self.server_client.post(resources, f"/{name}", json=args, cookies=cookies)
        cookies.update(response_cookies(resp))
        body = response_body(resp)
        if resp.status < 400:
            return body.decode(errors="replace")
        try:
            detail = orjson.loads(body)
        except orjson.JSONDecodeError:
            detail = {}
        error = detail.get("error", {}) if isinstance(detail, dict) else {}
        if resp.status == 422:
            return f"Error: invalid arguments for tool {name!r}: {error.get('message') or detail}"
        if resp.status == 500 and error.get("kind") == "internal_error":
            return f"Error: tool {name!r} failed: {error.get('type')}: {error.get('message')}"
        if resp.status == 404:
            return f"Error: tool {name!r} is not served by the resources server."
        # Anything else (502/503/504, ...) is the infrastructure failing, not the model's doing.
        raise UpstreamError(resources, f"/{name}", resp.status, detail or body.decode(errors="replace"))


if __name__ == "__main__":
    SimpleAgent.run_webserver()
