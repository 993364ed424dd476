"""bash_agent: the model writes one shell command per turn as text; the resources server runs it.

mini-swe-agent's idea, written here: no tool calling at all. One ``POST /run`` is one rollout:

1. ``POST /seed_session`` on the resources server with the task row (its session cookie is kept).
2. A model turn on ``responses_create_params`` with the row's ``tools`` removed (``drop_tools``) and
   ``system_prompt`` added to the system message: the model must answer with exactly one fenced ```` ```bash ```` block
   (``action_regex``, mini-swe-agent's name and default shape).
3. Exactly one block: its command goes to the resources server's ``bash`` tool (``POST /bash``
   ``{"command": ...}`` answering ``output``, ``exit_code`` and maybe ``timed_out``); the output, cut
   to its head and tail past ``max_output_chars`` with a marker saying how much was cut, comes back
   as the next user message. Zero or several blocks (or a tool call, or an answer cut short): a
   format-error message comes back instead and no command runs.
4. The loop stops when a command's output starts with ``submit_marker`` and it exited 0
   (mini-swe-agent's convention: ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``), after ``max_steps``
   model turns, once the turns used ``max_total_tokens`` tokens, or after
   ``max_consecutive_format_errors`` format errors in a row, or when the model answers ``incomplete``
   with nothing at all (its context is full).
5. ``POST /verify`` with the row and the trajectory, as simple_agent does; the answer is the verify
   response laid over the row plus ``stop_reason``, ``num_steps``, ``num_commands``,
   ``num_format_errors`` and ``submitted`` (numbers the collector averages as metrics).

Everything the model got wrong is text it reads. The resources server failing (unreachable, a timeout,
a 5xx, no ``bash`` route, an answer without ``output``) fails the rollout with a 502/504 naming it:
never a reward.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.client.server_client import response_cookies
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.errors import UpstreamError, response_body
from nemo_gym.kit.text import BASH_ACTION_PATTERN, bash_blocks, head_tail
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, new_id, text_of_message
from nemo_gym.server.agent import add_usage, empty_usage
from nemo_gym.server.base import validated_body
from nemo_gym.server.disconnect import ClientDisconnected, disconnected_response, run_until_disconnected

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# Stop reasons (``stop_reason`` of the /run answer).
SUBMITTED = "submitted"
MAX_STEPS = "max_steps"
MAX_TOTAL_TOKENS = "max_total_tokens"
FORMAT_ERRORS = "format_errors"
INCOMPLETE = "incomplete"

DEFAULT_SYSTEM_PROMPT = """\
You act only through shell commands: there are no tool calls here, whatever an earlier message says. \
Each of your answers must contain exactly ONE bash code block with ONE command (or commands joined \
with && or ||), after a short explanation of why:

```bash
your_command_here
```

The command runs in the task's working directory and you get back its exit code and output. Every \
command runs in a new shell: `cd` and variables do not carry over to the next one. Do not start \
interactive programs (editors, pagers). Edit files with commands such as `sed -i` or \
`cat <<'EOF' > file`.

When you are done, run exactly this command, alone:

```bash
echo {submit_marker}
```

You cannot continue after it."""

FORMAT_ERROR_TEXT = """\
Format error: {problem}

Answer with exactly ONE bash code block holding ONE command, like this:

```bash
your_command_here
```

When you are done, run `echo {submit_marker}` alone."""

# HTTP statuses of the bash tool that are the tool refusing this command on purpose (the model reads
# why); any other non-2xx is the resources server failing and fails the rollout.
_REFUSALS = {400, 409, 413}
# What a long output's marker says (nemo_gym.kit.text.head_tail): how much, and how to see the rest.
_CUT_NOTE = (
    "{cut} characters cut from the middle of this output ({total} in all); "
    "use head, tail, grep or sed -n to see a part of it"
)


class BashAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    # Model turns per rollout (format-error turns count): a looping model cannot hang a rollout.
    max_steps: int = Field(default=30, ge=1)
    # Cost limit: no further model turn once the turns so far used this many tokens (usage.total_tokens).
    max_total_tokens: int | None = Field(default=None, ge=1)
    # Stop after this many format errors in a row (mini-swe-agent's name and default).
    max_consecutive_format_errors: int = Field(default=3, ge=1)
    # The command of a turn: group 1 of each match (mini-swe-agent's name; its v1 default).
    # The default is matched by a linear scan (nemo_gym.kit.text.bash_blocks); another regex runs off the
    # event loop on answers of at most CUSTOM_REGEX_MAX_CHARS (a longer answer is a format error).
    action_regex: str = BASH_ACTION_PATTERN
    # A command whose output's first line is this, with exit code 0, submits.
    submit_marker: str = Field(default=SUBMIT_MARKER, min_length=1)
    # Output longer than this reaches the model as its first and last halves with a marker between.
    max_output_chars: int = Field(default=10_000, ge=100)
    # The resources server's route that runs a command (POST {"command": str}).
    bash_tool: str = "bash"
    # The format and the rules ({submit_marker} is filled in), appended to the row's first message when it
    # is a system/developer one, else put first as a system message; "" for none.
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    # Remove the row's ``tools`` from the model request: this agent runs no tool calls.
    drop_tools: bool = True

    @field_validator("action_regex")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            pattern = re.compile(value, re.DOTALL)
        except re.error as e:
            raise ValueError(f"action_regex {value!r} is not a regular expression: {e}") from None
        if pattern.groups != 1:
            raise ValueError(f"action_regex {value!r} must have exactly one group (the command)")
        return value


# What a custom action_regex reads at most: a regex's time on hostile text can grow with its square.
CUSTOM_REGEX_MAX_CHARS = 100_000


class AnswerTooLong(ValueError):
    """An answer past what a custom ``action_regex`` reads (a format error the model reads)."""


async def extract_commands(text: str, action_regex: str) -> list[str]:
    """The commands of a model answer: group 1 of every ``action_regex`` match, stripped. The default
    pattern is matched in linear time; another runs in a worker thread on at most
    :data:`CUSTOM_REGEX_MAX_CHARS` characters (:class:`AnswerTooLong` past it)."""
    if action_regex == BASH_ACTION_PATTERN:
        return [m.strip() for m in bash_blocks(text)]
    if len(text) > CUSTOM_REGEX_MAX_CHARS:
        raise AnswerTooLong(
            f"your answer is {len(text):,} characters; at most {CUSTOM_REGEX_MAX_CHARS:,} are read for a command."
        )
    found = await asyncio.to_thread(re.findall, action_regex, text, re.DOTALL)
    return [m.strip() for m in found]


def observation(output: str, exit_code: int | None, timed_out: bool, max_chars: int) -> str:
    """What the model reads after a command (mini-swe-agent's tags)."""
    parts = []
    if timed_out:
        parts.append("<warning>The command ran past its time limit and was killed.</warning>")
    parts.append(f"<returncode>{'none' if exit_code is None else exit_code}</returncode>")
    parts.append(f"<output>\n{head_tail(output, max_chars, _CUT_NOTE)}\n</output>")
    return "\n".join(parts)


def is_submission(output: str, exit_code: int | None, marker: str) -> bool:
    """mini-swe-agent's test: the output's first line is the marker and the command exited 0."""
    lines = output.lstrip().splitlines()
    return exit_code == 0 and bool(lines) and lines[0].strip() == marker


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


class BashAgent(SimpleResponsesAPIAgent):
    config: BashAgentConfig

    async def responses(self, request: Request) -> Response:
        """The loop for one request (no seeding, no verify; the commands run in the caller's resources
        session, by its cookies); returns the trajectory."""
        params = await validated_body(request, NeMoGymResponseCreateParamsNonStreaming)
        model_path = self.url_path_for_request("/v1/responses", request)
        try:
            response, _, _ = await run_until_disconnected(
                request, self.run_loop(params, dict(request.cookies), model_path)
            )
        except ClientDisconnected as e:
            return disconnected_response(self.config.name, e)
        return Response(orjson.dumps(response), media_type="application/json")

    async def run(self, request: Request) -> Response:
        """One rollout: seed, loop, verify; the verify response laid over the row, plus the loop's numbers."""
        row = await validated_body(request, BaseRunRequest)
        return await self.answer_until_disconnected(request, self._rollout(row, dict(request.cookies)))

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        model_path = self.url_path_for_run("/v1/responses", row)
        response, cookies, info = await self.run_loop(row["responses_create_params"], cookies, model_path)
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json={**row, "response": response},
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        return {**row, **verify, **info}

    # ------------------------------------------------------------------------------------------------
    def _model_params(self, params: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The request parameters without the input (tools dropped), and the input as items with the
        system prompt in the first message (the row's own system message, else one of its own)."""
        raw = params.get("input", [])
        items = [_user(raw)] if isinstance(raw, str) else list(raw)
        if self.config.system_prompt:
            prompt = self.config.system_prompt.replace("{submit_marker}", self.config.submit_marker)
            first = items[0] if items else {}
            if first.get("role") in ("system", "developer") and isinstance(first.get("content"), str):
                # One system message, the row's then ours (many chat templates allow only one, first).
                items = [{**first, "content": f"{first['content']}\n\n{prompt}"}, *items[1:]]
            else:
                items = [{"type": "message", "role": "system", "content": prompt}, *items]
        base = {k: v for k, v in params.items() if k != "input"}
        if self.config.drop_tools:
            for key in ("tools", "tool_choice", "parallel_tool_calls"):
                base.pop(key, None)
        return base, items

    async def run_loop(
        self, params: dict[str, Any], cookies: dict[str, str], model_path: str = "/v1/responses"
    ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        """The command loop. Returns the trajectory as one response (every turn's items and the
        observations in order, usage summed), the cookies, and the loop's numbers for the /run answer."""
        config = self.config
        model = config.model_server.name
        base, input_items = self._model_params(params)
        outputs: list[dict[str, Any]] = []
        usage = empty_usage()
        response: dict[str, Any] = {}
        steps = commands = format_errors = consecutive_errors = 0
        stop_reason = MAX_STEPS
        while steps < config.max_steps:
            if config.max_total_tokens is not None and usage["total_tokens"] >= config.max_total_tokens:
                stop_reason = MAX_TOTAL_TOKENS
                break
            steps += 1
            response, new_cookies = await self.server_client.post_json(
                model,
                model_path,
                json={**base, "input": input_items + outputs},
                cookies=cookies,
                **self.timeout("model_timeout_s"),
            )
            cookies.update(new_cookies)
            turn = response.get("output") or []
            outputs.extend(turn)
            add_usage(usage, response.get("usage"))
            if response.get("status") == "incomplete" and not turn:
                # Nothing at all (local_model's answer when the context is full): the conversation only
                # grows, so no later turn can do better.
                stop_reason = INCOMPLETE
                break
            problem = await self._format_problem(turn, response, outputs)
            if problem is not None:
                format_errors += 1
                consecutive_errors += 1
                if consecutive_errors >= config.max_consecutive_format_errors:
                    stop_reason = FORMAT_ERRORS
                    break
                outputs.append(
                    _user(FORMAT_ERROR_TEXT.format(problem=problem, submit_marker=config.submit_marker))
                )
                continue
            consecutive_errors = 0
            command = (await extract_commands(self._turn_text(turn), config.action_regex))[0]
            commands += 1
            output, exit_code, timed_out = await self.run_command(command, cookies)
            if is_submission(output, exit_code, config.submit_marker):
                stop_reason = SUBMITTED
                break
            outputs.append(_user(observation(output, exit_code, timed_out, config.max_output_chars)))
        self.observe_loop(steps, commands)  # nemo_gym.server.metrics
        info = {
            "stop_reason": stop_reason,
            "submitted": 1.0 if stop_reason == SUBMITTED else 0.0,
            "num_steps": steps,
            "num_commands": commands,
            "num_format_errors": format_errors,
        }
        return {**response, "output": outputs, "usage": usage}, cookies, info

    @staticmethod
    def _turn_text(turn: list[dict[str, Any]]) -> str:
        """The text of a turn's assistant messages (reasoning items are not searched for commands)."""
        return "\n".join(
            text_of_message(item)
            for item in turn
            if item.get("type", "message") == "message" and item.get("role") == "assistant"
        )

    async def _format_problem(
        self, turn: list[dict[str, Any]], response: dict[str, Any], outputs: list[dict[str, Any]]
    ) -> str | None:
        """Why this turn gives no single command, or None when it gives exactly one. A tool call gets a
        ``function_call_output`` (appended to ``outputs``) so the conversation stays well formed."""
        calls = [item for item in turn if item.get("type") == "function_call"]
        for call in calls:
            outputs.append(
                {
                    "type": "function_call_output",
                    "id": new_id("fco"),
                    "call_id": call.get("call_id", ""),
                    "output": "Error: there are no tools here; write your command in a bash code block.",
                    "status": "completed",
                }
            )
        if calls:
            return f"you called a tool ({', '.join(repr(c.get('name', '')) for c in calls)}); there are none."
        try:
            found = await extract_commands(self._turn_text(turn), self.config.action_regex)
        except AnswerTooLong as e:
            return str(e)
        if response.get("status") == "incomplete" and len(found) != 1:
            return "your answer was cut off (the output token limit) before it held one complete command."
        if not found:
            return "your answer has no bash code block."
        if len(found) > 1:
            return f"your answer has {len(found)} bash code blocks; exactly one is run per turn."
        if not found[0]:
            return "the bash code block is empty."
        return None

    async def run_command(self, command: str, cookies: dict[str, str]) -> tuple[str, int | None, bool]:
        """Run one command with the resources server's bash tool: (output, exit code, timed out).

        The tool refusing the command (400/409/413) is output the model reads; anything else that is not
        a well-formed 2xx answer is the infrastructure failing and raises :class:`UpstreamError`.
        """
        resources = self.config.resources_server.name
        path = f"/{self.config.bash_tool}"
        resp = await self.server_client.post(
            resources, path, json={"command": command}, cookies=cookies, **self.timeout("tool_timeout_s")
        )
        cookies.update(response_cookies(resp))
        body = response_body(resp)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if resp.status in _REFUSALS:
            detail = data.get("detail", data) if isinstance(data, dict) else body.decode(errors="replace")
            return f"Error: the command was refused (HTTP {resp.status}): {detail}", None, False
        if resp.status >= 300:
            raise UpstreamError(resources, path, resp.status, data or body.decode(errors="replace"))
        output = data.get("output") if isinstance(data, dict) else None
        exit_code = data.get("exit_code") if isinstance(data, dict) else None
        if not isinstance(output, str) or not (exit_code is None or isinstance(exit_code, int)):
            raise UpstreamError(
                resources,
                path,
                resp.status,
                f"the bash tool must answer {{'output': str, 'exit_code': int | null}}, got {body[:500]!r}",
                kind="bad_response",
            )
        return output, exit_code, bool(data.get("timed_out"))


if __name__ == "__main__":
    BashAgent.run_webserver()
