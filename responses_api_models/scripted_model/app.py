"""scripted_model: a deterministic stand-in for an LLM, for tests and benchmarks (no GPU, no key).

Default behaviour, per request: if tools are offered and the input holds no tool result yet, call the
first tool with arguments built from its JSON schema; otherwise answer with text (quoting the last
tool result when there is one).

A script can replace that. ``script`` is a list of turns played in order; the turn played is the
number of model turns already in the input, so the server keeps no state and concurrent rollouts
never interfere. ``scripts_by_input`` (and ``scripts_by_input_fpath``, a file of more rules) picks a script by a substring
of the first user message and/or the rollout id of the request (:mod:`nemo_gym.kit.script`).
A turn is a mapping with any of:
  text: "..."                       an assistant message
  echo: prompt | tool_outputs | tool_outputs_plain
                                    an assistant message repeating the first user message, or every
                                    tool output so far (``_plain``: without JSON's braces and quotes)
  reasoning: "..."                  a reasoning item (before the rest)
  tool_calls: [{name, arguments}]   function calls; arguments any JSON value (sent as JSON) or a raw
                                    string (sent as is, so invalid JSON can be scripted)
  http_error: 503                   answer this HTTP status instead (to exercise failure handling)
  delay_s: 0.5                      wait first
  incomplete: true                  status ``incomplete`` (reason ``max_output_tokens``; chat:
                                    ``finish_reason: length``), as a model whose output budget ran out
                                    (with no text or calls: whose context was full)
Past the end of a script the default behaviour applies.
``GET /stats`` says how many model requests this process has answered (for tests).
``stream: true`` sends the same answer as events, its text and arguments cut into pieces
(:mod:`nemo_gym.server.streaming`), so a reassembled stream equals the plain answer exactly.

With ``return_token_id_information: true`` the last output item of every answer (the assistant
message of a chat completion) carries ``prompt_token_ids`` / ``generation_token_ids`` /
``generation_log_probs``, and they behave like a real model's: turn N+1's ``prompt_token_ids`` start
with turn N's prompt and generation ids exactly (the contiguity trainers check). Token ids are the
UTF-8 bytes of a chat-template-like rendering (see :func:`render_prompt`): every assistant turn is
``<|assistant|>`` + its generation + ``<|end|>``, so re-rendering a conversation reproduces earlier
prompts and generations byte for byte. When an earlier assistant item in the input carries
``prompt_token_ids`` + ``generation_token_ids`` (as agents send them back), those ids are reused
verbatim and only what follows is rendered, as vLLM and local_model do.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import PrivateAttr

from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
from nemo_gym.kit.script import ScriptedToolCall, ScriptedTurn, ScriptRule, echoed_text, load_rules
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, dump, new_id, text_of_message
from nemo_gym.server.model import ModelAnswer
from nemo_gym.server.rollout_prefix import current_rollout_id


class ScriptedModelConfig(BaseResponsesAPIModelConfig):
    model_name: str = "scripted-model"
    script: list[ScriptedTurn] | None = None
    scripts_by_input: list[ScriptRule] | None = None
    # More rules, in a JSON or YAML file (a list of rules), checked before ``scripts_by_input``: for scripts
    # too large or too many for a config (ng_reward_audit writes one).
    scripts_by_input_fpath: str | None = None
    return_token_id_information: bool = False


def example_from_schema(schema: dict[str, Any] | None) -> Any:
    """A value that satisfies a (simple) JSON schema: enum/const/default/examples first, then by type."""
    schema = schema or {}
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    if schema.get("examples"):
        return schema["examples"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_from_schema(schema[key][0])
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object":
        props = schema.get("properties") or {}
        required = schema.get("required", list(props))
        return {name: example_from_schema(props.get(name)) for name in required}
    if kind == "array":
        return [example_from_schema(schema.get("items")) for _ in range(int(schema.get("minItems", 1)))]
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.0))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "example"


def _count_model_turns(items: list[dict[str, Any]]) -> int:
    """Model turns already in the input: maximal runs of assistant-produced items."""
    turns, in_turn = 0, False
    for item in items:
        t = item.get("type", "message")
        produced = t in ("function_call", "reasoning") or (t == "message" and item.get("role") == "assistant")
        if produced and not in_turn:
            turns += 1
        in_turn = produced
    return turns


TURN_START = "<|assistant|>"
TURN_END = "<|end|>"


def _is_model_item(item: dict[str, Any]) -> bool:
    t = item.get("type", "message")
    return t in ("function_call", "reasoning") or (t == "message" and item.get("role") == "assistant")


def render_generation(items: list[dict[str, Any]]) -> str:
    """What the model generated for one turn's ``items`` (reasoning, calls, text), ending with ``<|end|>``."""
    parts = []
    for item in items:
        t = item.get("type", "message")
        if t == "function_call":
            parts.append(f"<|call|>{item.get('name', '')}({item.get('arguments', '')})")
        elif t == "reasoning":
            parts.append("<|think|>" + "".join(str(s.get("text", "")) for s in item.get("summary") or []))
        else:
            parts.append(text_of_message(item))
    return "".join(parts) + TURN_END


def render_items(items: list[dict[str, Any]]) -> str:
    """A chat-template-like rendering of items' content (ids, statuses and token ids are ignored).

    Each maximal run of model-produced items is one assistant turn: ``<|assistant|>`` followed by
    :func:`render_generation` of the run, so a prompt plus its generation is a prefix of the next prompt.
    """
    parts = []
    run: list[dict[str, Any]] = []
    for item in items:
        if _is_model_item(item):
            run.append(item)
            continue
        if run:
            parts.append(TURN_START + render_generation(run))
            run = []
        t = item.get("type", "message")
        if t == "message":
            parts.append(f"<|{item.get('role', 'user')}|>{text_of_message(item)}")
        elif t == "function_call_output":
            output = item.get("output")
            parts.append(f"<|tool|>{output if isinstance(output, str) else orjson.dumps(output).decode()}")
        else:
            parts.append(f"<|{t}|>")
    if run:
        parts.append(TURN_START + render_generation(run))
    return "".join(parts)


def render_prompt(items: list[dict[str, Any]]) -> str:
    """The prompt for the next turn: the rendered conversation plus the generation prompt."""
    return render_items(items) + TURN_START


def prompt_token_ids(items: list[dict[str, Any]]) -> list[int]:
    """Token ids of the next turn's prompt.

    The last input item carrying both ``prompt_token_ids`` and ``generation_token_ids`` contributes
    those ids verbatim (never re-tokenised); only the items after it are rendered. Without such an
    item the whole conversation is rendered.
    """
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        carried_prompt, carried_generation = item.get("prompt_token_ids"), item.get("generation_token_ids")
        if carried_prompt and carried_generation:
            rest = items[index + 1 :]
            return [*carried_prompt, *carried_generation, *fake_token_ids(render_prompt(rest))]
    return fake_token_ids(render_prompt(items))


def fake_token_ids(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def fake_log_probs(token_ids: list[int]) -> list[float]:
    """A deterministic, varied log-probability per token (so a changed value would be noticed)."""
    return [-round(0.01 * (tid % 97 + 1), 2) for tid in token_ids]


class ScriptedModel(SimpleResponsesAPIModel):
    config: ScriptedModelConfig
    uses_sessions = False
    _requests: int = PrivateAttr(default=0)
    _rules: list[ScriptRule] = PrivateAttr(default_factory=list)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/stats")(self.stats)
        return app

    async def stats(self) -> dict[str, int]:
        """``GET /stats``: how many model requests (both APIs) this process has answered, for tests."""
        return {"requests": self._requests}

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        path = self.config.scripts_by_input_fpath
        self._rules = [*(load_rules(path) if path else []), *(self.config.scripts_by_input or [])]

    def _pick_turn(self, items: list[dict[str, Any]]) -> ScriptedTurn | None:
        turns = self.config.script
        first_user = next((i for i in items if i.get("role") == "user"), None)
        text = text_of_message(first_user) if first_user is not None else None
        rollout_id = current_rollout_id()
        for rule in self._rules:
            if rule.matches(text, rollout_id):
                turns = rule.turns
                break
        index = _count_model_turns(items)
        if turns and index < len(turns):
            turn = turns[index]
            if turn.echo is not None:
                echoed = echoed_text(turn.echo, items, text)
                turn = turn.model_copy(update={"echo": None, "text": echoed})
            return turn
        return None

    def _default_turn(self, items: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ScriptedTurn:
        results = [i for i in items if i.get("type") == "function_call_output"]
        functions = [t for t in tools if t.get("type", "function") == "function"]
        if functions and not results:
            tool = functions[0]
            args = example_from_schema(tool.get("parameters"))
            return ScriptedTurn(tool_calls=[ScriptedToolCall(name=tool["name"], arguments=args)])
        if results:
            output = results[-1].get("output")
            output = output if isinstance(output, str) else orjson.dumps(output).decode()
            return ScriptedTurn(text=f"The tool returned: {output}")
        return ScriptedTurn(text="Hello! I am a scripted model.")

    async def _turn(self, items: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ScriptedTurn:
        self._requests += 1
        turn = self._pick_turn(items) or self._default_turn(items, tools)
        if turn.delay_s:
            await asyncio.sleep(turn.delay_s)
        return turn

    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        params = dump(body)
        raw = params.get("input", [])
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        turn = await self._turn(items, params.get("tools") or [])
        if turn.http_error:
            return _error(turn.http_error)
        prompt_items = list(items)
        if params.get("instructions"):
            prompt_items.insert(0, {"role": "system", "content": params["instructions"]})
        output: list[dict[str, Any]] = []
        if turn.reasoning is not None:
            output.append(
                {
                    "type": "reasoning",
                    "id": new_id("rs"),
                    "summary": [{"type": "summary_text", "text": turn.reasoning}],
                }
            )
        for call in turn.tool_calls or []:
            output.append(
                {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": new_id("call"),
                    "name": call.name,
                    "arguments": call.arguments_text(),
                    "status": "completed",
                }
            )
        if turn.text is not None:
            output.append(
                {
                    "type": "message",
                    "id": new_id("msg"),
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": turn.text, "annotations": []}],
                }
            )
        generated = render_generation(output)
        if self.config.return_token_id_information and output:
            gen_ids = fake_token_ids(generated)
            prompt_ids = prompt_token_ids(prompt_items)
            output[-1].update(
                prompt_token_ids=prompt_ids,
                generation_token_ids=gen_ids,
                generation_log_probs=fake_log_probs(gen_ids),
            )
            usage_in, usage_out = len(prompt_ids), len(gen_ids)
        else:
            usage_in, usage_out = len(render_prompt(prompt_items)) // 4 + 1, len(generated) // 4 + 1
        response = {
            "id": new_id("resp"),
            "object": "response",
            "created_at": float(int(time.time())),
            "model": params.get("model") or self.config.model_name,
            "status": "incomplete" if turn.incomplete else "completed",
            "output": output,
            "usage": {
                "input_tokens": usage_in,
                "output_tokens": usage_out,
                "total_tokens": usage_in + usage_out,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            "parallel_tool_calls": params.get("parallel_tool_calls") is not False,
            "tool_choice": params.get("tool_choice") or "auto",
            "tools": params.get("tools") or [],
            "temperature": params.get("temperature"),
            "top_p": params.get("top_p"),
            "max_output_tokens": params.get("max_output_tokens"),
            "instructions": params.get("instructions"),
            "metadata": params.get("metadata"),
            "incomplete_details": {"reason": "max_output_tokens"} if turn.incomplete else None,
            "error": None,
        }
        return ModelAnswer(response)

    async def chat_completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            error = {"kind": "bad_request", "message": "`messages` must be a list of objects with a `role`."}
            return Response(orjson.dumps({"error": error}), status_code=400, media_type="application/json")
        items: list[dict[str, Any]] = []
        for m in messages:
            if m.get("role") == "tool":
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": m.get("tool_call_id", ""),
                        "output": m.get("content", ""),
                    }
                )
            elif m.get("role") == "assistant":
                turn_items: list[dict[str, Any]] = []
                if m.get("content"):
                    turn_items.append({"role": "assistant", "content": m["content"]})
                for tc in m.get("tool_calls") or []:
                    turn_items.append(
                        {
                            "type": "function_call",
                            "name": tc["function"]["name"],
                            "arguments": tc["function"]["arguments"],
                        }
                    )
                if not turn_items:
                    turn_items.append({"role": "assistant", "content": ""})
                for field in ("prompt_token_ids", "generation_token_ids"):
                    if m.get(field):
                        turn_items[-1][field] = m[field]
                items.extend(turn_items)
            else:
                items.append({"role": m.get("role", "user"), "content": m.get("content") or ""})
        tools = [
            {"type": "function", **t["function"]}
            for t in body.get("tools") or []
            if t.get("type") == "function"
        ]
        turn = await self._turn(items, tools)
        if turn.http_error:
            return _error(turn.http_error)
        message: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": new_id("call"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_text()},
                }
                for c in turn.tool_calls
            ]
        if self.config.return_token_id_information:
            # Rendered in the order the next request's messages are read back (text, then calls).
            answer_items: list[dict[str, Any]] = []
            if turn.text:
                answer_items.append({"role": "assistant", "content": turn.text})
            answer_items += [
                {"type": "function_call", **c["function"]} for c in message.get("tool_calls", [])
            ]
            prompt_ids = prompt_token_ids(items)
            gen_ids = fake_token_ids(render_generation(answer_items))
            message.update(
                prompt_token_ids=prompt_ids,
                generation_token_ids=gen_ids,
                generation_log_probs=fake_log_probs(gen_ids),
            )
            prompt_len, completion_len = len(prompt_ids), len(gen_ids)
        else:
            prompt_len = len(orjson.dumps(messages)) // 4 + 1
            completion_len = len(orjson.dumps(message)) // 4 + 1
        result = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.config.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "length"
                    if turn.incomplete
                    else "tool_calls"
                    if turn.tool_calls
                    else "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion_len,
                "total_tokens": prompt_len + completion_len,
            },
        }
        return ModelAnswer(result)


def _error(status: int) -> Response:
    body = {"error": {"kind": "scripted_error", "message": f"scripted HTTP {status}"}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


if __name__ == "__main__":
    ScriptedModel.run_webserver()
