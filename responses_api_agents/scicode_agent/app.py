"""scicode_agent: SciCode's step-by-step harness as an agent: one model call per sub-step, the code kept.

One ``POST /run`` is one rollout of a multi-step problem row (``resources_servers/scientific_code``):

1. ``POST /seed_session`` with the row (the resources server refuses a broken row there: 422).
2. For each entry k of the row's ``sub_steps``, a fresh model request: the row's
   ``responses_create_params`` with its last user message extended by :func:`step_prompt`: the step's
   number and description, the code the model wrote for steps 1..k-1 (its own earlier answers, as
   SciCode's harness shows them), and the header and return line of the function to write. The model
   answers with a code block; its last fenced block is kept as the step's code and the agent moves on,
   whatever the answer was (a step without code shows as missing to the later steps).
3. ``POST /verify`` with the row, every step's output items as ``response`` (usage summed) and the
   answer text of each step as ``step_answers``.

Once the model has written more than ``max_model_chars`` characters in the rollout's answers (default
4,000,000: a resources server's ``verify_max_model_chars``, past which ``/verify`` scores the rollout 0
as "the answer is too long" without reading it), the later steps are not asked: the verify request goes
with the answers so far. So an over-long answer is the model's 0 with that reason, and never a request
larger than the resources server takes (each answer travels twice, in ``response`` and in
``step_answers``: three 10 MB answers were a 60 MB request, refused with a 413 and so never scored).

There are no tools and no retries: each step is exactly one model turn, as in SciCode. ``POST
/v1/responses`` makes one model call with the given parameters (one step, no seeding, no verify).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.kit.text import last_code_block
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, text_of_message
from nemo_gym.server.agent import add_usage, empty_usage
from nemo_gym.server.base import validated_body
from nemo_gym.server.disconnect import ClientDisconnected, disconnected_response, run_until_disconnected
from nemo_gym.server.resources import model_written_chars


class SciCodeAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    max_model_chars: int = Field(
        default=4_000_000,
        ge=1,
        description="Past this many characters written by the model, the later steps are not asked (keep it at "
        "the resources server's verify_max_model_chars)",
    )


def extract_code(text: str) -> str | None:
    """The last fenced code block (python-tagged ones first), the rule the verifier applies too (linear in
    the answer's length: :func:`nemo_gym.kit.text.last_code_block`)."""
    return last_code_block(text)


def step_prompt(steps: list[dict[str, Any]], k: int, codes: list[str | None]) -> str:
    """What is added to the row's user message for step ``k`` (0-based): the step, the model's code for
    the earlier steps and the header to implement. It starts with ``STEP <step_number>``."""
    step = steps[k]
    lines = [
        f"STEP {step['step_number']} ({k + 1} of {len(steps)}): {step.get('step_description_prompt', '')}"
    ]
    if k:
        earlier = "\n\n".join(
            code.strip("\n") if code is not None else f"# step {steps[i]['step_number']}: no code was given"
            for i, code in enumerate(codes[:k])
        )
        lines += [
            "",
            "Your code for the earlier steps (already defined; call these functions by name):",
            "```python",
            earlier,
            "```",
        ]
    lines += [
        "",
        "Write this function, with this header and this return line:",
        "```python",
        step["function_header"],
        "",
        step.get("return_line", ""),
        "```",
        "Answer with one ```python``` block holding the complete function.",
    ]
    return "\n".join(lines)


def output_text(response: dict[str, Any]) -> str:
    """The text of the assistant messages of one model response."""
    return "".join(
        part.get("text", "") or ""
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


class SciCodeAgent(SimpleResponsesAPIAgent):
    config: SciCodeAgentConfig

    async def responses(self, request: Request) -> Response:
        """One model call (one step's prompt), passed through."""
        params = await validated_body(request, NeMoGymResponseCreateParamsNonStreaming)
        model_path = self.url_path_for_request("/v1/responses", request)
        try:
            response, _ = await run_until_disconnected(
                request,
                self.server_client.post_json(
                    self.config.model_server.name,
                    model_path,
                    json=params,
                    cookies=dict(request.cookies),
                    **self.timeout("model_timeout_s"),
                ),
            )
        except ClientDisconnected as e:
            return disconnected_response(self.config.name, e)
        return Response(orjson.dumps(response), media_type="application/json")

    async def run(self, request: Request) -> Response:
        row = await validated_body(request, BaseRunRequest)
        return await self.answer_until_disconnected(request, self._rollout(row, dict(request.cookies)))

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        resources = self.config.resources_server.name
        model = self.config.model_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        steps: list[dict[str, Any]] = row["sub_steps"]  # checked by /seed_session
        params = row["responses_create_params"]
        raw = params.get("input", [])
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        last_user = max((i for i, item in enumerate(items) if item.get("role") == "user"), default=None)
        model_path = self.url_path_for_run("/v1/responses", row)
        outputs: list[dict[str, Any]] = []
        usage = empty_usage()
        answers: list[str] = []
        codes: list[str | None] = []
        response: dict[str, Any] = {}
        written = 0
        for k in range(len(steps)):
            if written > self.config.max_model_chars:  # too long to be read: /verify scores it 0
                break
            prompt = step_prompt(steps, k, codes)
            if last_user is None:
                step_items = [*items, {"role": "user", "content": prompt}]
            else:
                user = items[last_user]
                step_items = [
                    *items[:last_user],
                    {**user, "content": f"{text_of_message(user)}\n\n{prompt}"},
                    *items[last_user + 1 :],
                ]
            response, new_cookies = await self.server_client.post_json(
                model,
                model_path,
                json={**params, "input": step_items},
                cookies=cookies,
                **self.timeout("model_timeout_s"),
            )
            cookies.update(new_cookies)
            outputs.extend(response.get("output") or [])
            written += model_written_chars({"output": response.get("output") or []})
            add_usage(usage, response.get("usage"))
            answers.append(output_text(response))
            codes.append(extract_code(answers[-1]))
        self.observe_loop(len(answers), 0)  # nemo_gym.server.metrics
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json={
                **row,
                "response": {**response, "output": outputs, "usage": usage},
                "step_answers": answers,
            },
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        return {**row, **verify}


if __name__ == "__main__":
    SciCodeAgent.run_webserver()
