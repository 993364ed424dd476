"""A scripted, deterministic stand-in for a vLLM OpenAI-compatible server (tests only: no GPU, no model).

It speaks vLLM's real wire formats, so ``vllm_model`` (and ``openai_model``) can be tested end to end:

* ``POST /v1/chat/completions`` - vLLM's response shape: ``message.tool_calls`` always a list,
  ``message.reasoning_content`` (with ``--reasoning-parser``; otherwise the reasoning stays in the
  content as ``<think>...</think>``, as vLLM without a reasoning parser returns it),
  ``choices[].logprobs.content[]`` entries ``{"token", "logprob", "bytes", "top_logprobs"}`` where
  ``token`` is ``"token_id:<n>"`` when ``return_tokens_as_token_ids`` is set, ``finish_reason``
  ``stop``/``tool_calls``/``length``, and ``usage``. A prompt that does not fit ``--max-model-len``
  is vLLM's 400 (``{"object": "error", "message": "This model's maximum context length is ...",
  "type": "BadRequestError", "param": null, "code": 400}``); an unknown model is vLLM's 404.
* ``POST /tokenize`` (at the root, as in vLLM) - ``{"messages", "tools", "add_generation_prompt"}``
  or ``{"prompt"}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``.
* ``POST /v1/completions`` - vLLM's Completions answer: ``prompt`` as text(s) or token ids (an id
  outside the vocabulary is vLLM's 400 "Token id N is out of vocabulary"), ``n``, ``stop`` (text cut
  before it, ``stop_reason``), ``logprobs`` (``tokens``/``token_logprobs``/``top_logprobs``/
  ``text_offset``; with ``echo`` the prompt's tokens lead, the first unscored), ``return_token_ids``
  (``prompt_token_ids`` and ``token_ids`` per choice) and ``return_tokens_as_token_ids``. The text is
  the first scripted turn's ``content`` whose tag the prompt contains, else a fixed greeting, then
  ``<|im_end|>``.
* ``POST /v1/responses`` - a minimal OpenAI Responses endpoint (for ``openai_model``'s tests).
* ``stream: true`` on both: the same answer as server-sent events, a few characters per delta with a
  short pause between deltas (chat: ``chat.completion.chunk`` objects, the usage chunk with
  ``stream_options.include_usage``, ``data: [DONE]``; responses: OpenAI's ``response.*`` events).
* ``return_token_ids`` on chat completions (vLLM >= 0.10.2): the answer's ``prompt_token_ids`` and the
  choice's ``token_ids``; streamed, ``prompt_token_ids`` on the first chunk and ``token_ids`` (with their
  ``logprobs``) spread over the chunks.
* ``GET /v1/models``.

The "model": a byte-level tokenizer (byte ``b`` is token ``b + 16``; a few special tokens) and a
ChatML-like template that, like Qwen3's, drops the reasoning of earlier assistant turns. An
assistant message carrying ``prompt_token_ids`` + ``generation_token_ids`` has its part of the
prompt replaced by exactly those ids (the contract of a trainer-patched vLLM that avoids
re-tokenisation), in both ``/tokenize`` and chat completions; ``honor_token_ids: false`` turns that
off (stock vLLM ignores the fields). Answers follow scripts picked by a substring of the first user
message (turn = number of assistant messages so far), else a default (call the first tool, then
quote its result). Log probs are a fixed function of token id and position.

Test control (not part of any real API): ``POST /_control`` ``{"fail_next": [429, {"status": 503,
"retry_after": "0"}], "honor_token_ids": bool, "return_token_ids": bool, "scripts": {substring:
[turn, ...]}, "reset_calls": true}``; ``GET /_calls`` -> ``{"name", "counts": {path: n}, "requests": [{"path", "body",
"authorized"}]}``. With ``--api-key`` every ``/v1/...`` request needs ``Authorization: Bearer <key>``;
a wrong key gets OpenAI's 401, which (like a careless server) echoes the key it was sent.

Run: ``python fake_vllm_backend.py --fd <listening socket fd> [--name A] [--model fake-model]``
(or ``--port``). :class:`FakeBackend` starts one as a real process on 127.0.0.1 and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

SPECIAL_TOKENS = {
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<think>": 3,
    "</think>": 4,
    "<tool_call>": 5,
    "</tool_call>": 6,
}
SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}
SKIPPED_WHEN_DECODING = {1, 2}  # like vLLM's skip_special_tokens: chat markers go, think/tool tags stay
BYTE_OFFSET = 16
VOCAB_SIZE = 256 + BYTE_OFFSET  # ids 0..15 special (some unused), then one per byte
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


# ------------------------------------------------------------------------------------------------
# The "tokenizer" and "chat template" (pure functions; tests import them to compute expectations).


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    for piece in _SPECIAL_RE.split(text):
        if piece in SPECIAL_TOKENS:
            ids.append(SPECIAL_TOKENS[piece])
        elif piece:
            ids.extend(b + BYTE_OFFSET for b in piece.encode("utf-8"))
    return ids


def token_bytes(token_id: int) -> bytes:
    if token_id in SPECIAL_BY_ID:
        return SPECIAL_BY_ID[token_id].encode()
    return bytes([token_id - BYTE_OFFSET])


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    out = b"".join(token_bytes(t) for t in ids if not (skip_special_tokens and t in SKIPPED_WHEN_DECODING))
    return out.decode("utf-8", errors="replace")


def logprob_of(token_id: int, position: int) -> float:
    return -round(((token_id * 31 + position * 7) % 50 + 1) / 100, 2)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.get("type") == "text":
            out.append(part.get("text", ""))
        elif part.get("type") == "image_url":
            out.append("<image>")
    return "".join(out)


def render_tool_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def render(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> str:
    """The chat template. Assistant history is rendered without its reasoning (as Qwen3's template does)."""
    out = []
    rest = list(messages)
    if tools:
        header = "# Tools\n" + "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
        if rest and rest[0].get("role") == "system":
            out.append(f"<|im_start|>system\n{_content_text(rest[0].get('content'))}\n\n{header}<|im_end|>\n")
            rest = rest[1:]
        else:
            out.append(f"<|im_start|>system\n{header}<|im_end|>\n")
    for m in rest:
        role = m.get("role")
        if role in ("system", "user"):
            out.append(f"<|im_start|>{role}\n{_content_text(m.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            calls = "".join(
                render_tool_call(tc["function"]["name"], tc["function"]["arguments"])
                for tc in m.get("tool_calls") or []
            )
            out.append(f"<|im_start|>assistant\n{_content_text(m.get('content'))}{calls}<|im_end|>\n")
        elif role == "tool":
            out.append(
                f"<|im_start|>user\n<tool_response>\n{_content_text(m.get('content'))}\n</tool_response><|im_end|>\n"
            )
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def prompt_token_ids(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    honor_token_ids: bool,
) -> list[int]:
    """The prompt's token ids; the part up to the last assistant message carrying token ids is those ids."""
    full = render(messages, tools, add_generation_prompt)
    if honor_token_ids:
        for k in range(len(messages) - 1, -1, -1):
            m = messages[k]
            if (
                m.get("role") == "assistant"
                and m.get("prompt_token_ids") is not None
                and m.get("generation_token_ids") is not None
            ):
                prefix = render(messages[: k + 1], tools, False)
                assert full.startswith(prefix)
                return (
                    list(m["prompt_token_ids"])
                    + list(m["generation_token_ids"])
                    + tokenize("\n" + full[len(prefix) :])
                )
    return tokenize(full)


def generation_text(turn: dict[str, Any]) -> str:
    """What the model generates for a turn, as one string (ends with the end-of-turn token)."""
    text = ""
    if turn.get("reasoning"):
        text += f"<think>\n{turn['reasoning']}\n</think>\n\n"
    text += turn.get("content") or ""
    for call in turn.get("tool_calls") or []:
        text += render_tool_call(call["name"], _arguments_text(call.get("arguments")))
    return text + "<|im_end|>"


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})


def _example_arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    props = (parameters or {}).get("properties") or {}
    required = (parameters or {}).get("required", list(props))
    return {name: "example" for name in required}


# ------------------------------------------------------------------------------------------------
# The server.


class _State:
    def __init__(
        self, name: str, model: str, api_key: str | None, reasoning_parser: bool, max_model_len: int
    ):
        self.name, self.model, self.api_key = name, model, api_key
        self.reasoning_parser, self.max_model_len = reasoning_parser, max_model_len
        self.fail_next: list[Any] = []
        self.honor_token_ids = True
        # False: ignore the request's return_token_ids, as a vLLM older than 0.10.2 does.
        self.return_token_ids = True
        self.scripts: dict[str, list[dict[str, Any]]] = {}
        self.counts: Counter[str] = Counter()
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()


def build_app(state: _State) -> FastAPI:
    app = FastAPI()

    def vllm_error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse(
            {"object": "error", "message": message, "type": kind, "param": None, "code": status}, status
        )

    async def admit(request: Request) -> tuple[dict[str, Any], JSONResponse | None]:
        """Record the call, then apply auth and scripted failures; returns (body, error response or None)."""
        body = await request.json()
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        authorized = state.api_key is None or given == state.api_key
        with state.lock:
            state.counts[request.url.path] += 1
            state.requests.append({"path": request.url.path, "body": body, "authorized": authorized})
            del state.requests[:-300]
            failure = state.fail_next.pop(0) if state.fail_next else None
        if failure is not None:
            spec = failure if isinstance(failure, dict) else {"status": failure}
            headers = {"retry-after": str(spec["retry_after"])} if "retry_after" in spec else None
            error = {
                "message": f"scripted failure {spec['status']}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            return body, JSONResponse({"error": error}, spec["status"], headers=headers)
        if request.url.path.startswith("/v1/") and not authorized:
            error = {
                "message": f"Incorrect API key provided: {given}. You can find your API key at https://example.invalid/keys.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            return body, JSONResponse({"error": error}, 401)
        return body, None

    def pick_turn(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        first_user = next((_content_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        index = sum(1 for m in messages if m.get("role") == "assistant")
        for tag, turns in state.scripts.items():
            if tag in first_user:
                if index < len(turns):
                    return turns[index]
                break
        results = [m for m in messages if m.get("role") == "tool"]
        if tools and not results:
            function = tools[0].get("function", tools[0])
            return {
                "reasoning": f"I should call {function['name']}.",
                "tool_calls": [
                    {"name": function["name"], "arguments": _example_arguments(function.get("parameters"))}
                ],
            }
        if results:
            return {
                "reasoning": "I have the tool result.",
                "content": f"The tool said: {_content_text(results[-1].get('content'))}",
            }
        return {"reasoning": "The user said something.", "content": "Hello! I am a fake vLLM model."}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model,
                    "object": "model",
                    "owned_by": "vllm",
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> JSONResponse:
        body, error = await admit(request)
        if error is not None:
            return error
        if body.get("model") not in (None, state.model):
            return vllm_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if "messages" in body:
            ids = prompt_token_ids(
                body["messages"],
                body.get("tools"),
                body.get("add_generation_prompt", True),
                state.honor_token_ids,
            )
        else:
            ids = tokenize(body.get("prompt", ""))
        return JSONResponse(
            {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        body, error = await admit(request)
        if error is not None:
            return error
        if body.get("model") != state.model:
            return vllm_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        messages, tools = body.get("messages") or [], body.get("tools")
        turn = pick_turn(messages, tools)
        if turn.get("http_error"):
            return vllm_error(
                turn["http_error"], f"scripted HTTP {turn['http_error']}", "InternalServerError"
            )
        prompt = prompt_token_ids(messages, tools, True, state.honor_token_ids)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if len(prompt) + (max_tokens or 0) > state.max_model_len or len(prompt) >= state.max_model_len:
            return vllm_error(
                400,
                f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
                f"{len(prompt) + (max_tokens or 0)} tokens ({len(prompt)} in the messages, {max_tokens or 0} in the "
                "completion). Please reduce the length of the messages or completion.",
                "BadRequestError",
            )
        gen_ids = tokenize(generation_text(turn))
        seed = hashlib.sha1(bytes(str(prompt), "utf-8")).hexdigest()
        if max_tokens and len(gen_ids) > max_tokens:
            gen_ids, finish = gen_ids[:max_tokens], "length"
            raw = decode(gen_ids)
            content: str | None = raw
            reasoning: str | None = None
            if state.reasoning_parser and raw.startswith("<think>"):
                if "</think>" in raw:
                    reasoning, _, content = raw[len("<think>") :].partition("</think>")
                    reasoning, content = reasoning.strip(), content.lstrip() or None
                else:
                    reasoning, content = raw[len("<think>") :].strip(), None
            tool_calls: list[dict[str, Any]] = []
        else:
            finish = "tool_calls" if turn.get("tool_calls") else "stop"
            content, reasoning = turn.get("content") or None, turn.get("reasoning")
            if reasoning and not state.reasoning_parser:
                content, reasoning = f"<think>\n{reasoning}\n</think>\n\n{content or ''}", None
            tool_calls = [
                {
                    "id": f"chatcmpl-tool-{seed[:8]}{i:02d}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": _arguments_text(c.get("arguments"))},
                }
                for i, c in enumerate(turn.get("tool_calls") or [])
            ]
        message = {
            "role": "assistant",
            "reasoning_content": reasoning,
            "content": content,
            "tool_calls": tool_calls,
        }
        logprobs = None
        if body.get("logprobs"):
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            logprobs = {
                "content": [
                    {
                        "token": f"token_id:{t}"
                        if as_ids
                        else token_bytes(t).decode("utf-8", errors="replace"),
                        "logprob": logprob_of(t, i),
                        "bytes": list(token_bytes(t)),
                        "top_logprobs": [],
                    }
                    for i, t in enumerate(gen_ids)
                ]
            }
        result = {
            "id": f"chatcmpl-{seed[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(gen_ids),
                "completion_tokens": len(gen_ids),
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
        }
        ids_asked = bool(body.get("return_token_ids")) and state.return_token_ids
        if ids_asked:  # vLLM >= 0.10.2: the prompt's ids on the answer, the generated ones per choice
            result["prompt_token_ids"] = list(prompt)
            result["choices"][0]["token_ids"] = list(gen_ids)
        if body.get("stream") is True:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                chat_chunks(result, include_usage, gen_ids if ids_asked else None),
                media_type="text/event-stream",
                headers={"x-fake-backend": state.name},
            )
        return JSONResponse(result, headers={"x-fake-backend": state.name})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body, error = await admit(request)
        if error is not None:
            return error
        if body.get("model") != state.model:
            return vllm_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompts = [tokenize(raw)]
        elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
            prompts = [tokenize(p) for p in raw]
        elif isinstance(raw, list) and raw and all(isinstance(p, int) for p in raw):
            prompts = [list(raw)]
        elif isinstance(raw, list) and raw and all(isinstance(p, list) for p in raw):
            prompts = [list(p) for p in raw]
        else:
            return vllm_error(
                400, "prompt must be a string, array of strings or array of tokens", "BadRequestError"
            )
        for ids in prompts:
            bad = [t for t in ids if not 0 <= t < VOCAB_SIZE]
            if bad:  # vLLM's wording (its input processor)
                return vllm_error(400, f"Token id {max(bad)} is out of vocabulary", "BadRequestError")
        max_tokens = body.get("max_tokens") or 16
        n = int(body.get("n") or 1)
        k = body.get("logprobs")
        echo = bool(body.get("echo"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)

        def shown(t: int) -> str:
            return f"token_id:{t}" if as_ids else token_bytes(t).decode("utf-8", errors="replace")

        choices, prompt_total, completion_total = [], 0, 0
        for p_index, ids in enumerate(prompts):
            prompt_total += len(ids)
            if len(ids) + max_tokens > state.max_model_len:
                return vllm_error(
                    400,
                    f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion).",
                    "BadRequestError",
                )
            prompt_text = decode(ids)
            script = next((turns for tag, turns in state.scripts.items() if tag in prompt_text), None)
            reply = (script[0].get("content") if script else None) or "Hello! I am a fake vLLM model."
            gen = tokenize(reply) + [SPECIAL_TOKENS["<|im_end|>"]]
            finish, stop_reason, text = "stop", None, reply
            text_len = len(reply)
            for stop in stops:
                at = reply.find(stop) if stop else -1
                if at >= 0 and (stop_reason is None or at < text_len):
                    text_len, stop_reason = at, stop
            if stop_reason is not None:
                text = reply[:text_len]
                # up to the token that completed the stop string (vLLM keeps it in token_ids)
                gen = tokenize(reply[: text_len + len(stop_reason)])
            if len(gen) > max_tokens:
                gen, finish, stop_reason = gen[:max_tokens], "length", None
                text = decode(gen)
            completion_total += len(gen) * n
            for j in range(n):
                logprobs = None
                if k is not None:
                    shown_ids = (ids if echo else []) + gen
                    token_logprobs: list[float | None] = []
                    top: list[dict[str, float] | None] = []
                    for i, t in enumerate(shown_ids):
                        prompt_part = echo and i < len(ids)
                        if prompt_part and i == 0:
                            token_logprobs.append(None)
                            top.append(None)
                            continue
                        pos = i if prompt_part else i - (len(ids) if echo else 0)
                        lp = logprob_of(t, pos)
                        token_logprobs.append(lp)
                        alts = {shown(t): lp}
                        for a in range(1, int(k) + 1):
                            alts.setdefault(shown((t + a) % VOCAB_SIZE), round(lp - a, 2))
                        top.append(alts)
                    offsets, at = [], 0
                    for t in shown_ids:
                        offsets.append(at)
                        at += len(decode([t]))
                    logprobs = {
                        "text_offset": offsets,
                        "token_logprobs": token_logprobs,
                        "tokens": [shown(t) for t in shown_ids],
                        "top_logprobs": top,
                    }
                choice: dict[str, Any] = {
                    "index": p_index * n + j,
                    "text": (prompt_text if echo else "") + text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "prompt_logprobs": None,
                }
                if body.get("return_token_ids"):
                    choice["prompt_token_ids"] = list(ids)
                    choice["token_ids"] = list(gen)
                choices.append(choice)
        digest = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()
        result = {
            "id": f"cmpl-{digest[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_total,
                "total_tokens": prompt_total + completion_total,
                "completion_tokens": completion_total,
                "prompt_tokens_details": None,
            },
        }
        return JSONResponse(result, headers={"x-fake-backend": state.name})

    @app.post("/v1/responses")
    async def responses(request: Request) -> JSONResponse:
        body, error = await admit(request)
        if error is not None:
            return error
        if body.get("model") != state.model:
            error = {
                "message": f"The model `{body.get('model')}` does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, 404)
        raw = body.get("input")
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw or []
        results = [i for i in items if i.get("type") == "function_call_output"]
        tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
        digest = hashlib.sha1(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]
        if tools and not results:
            output: list[dict[str, Any]] = [
                {
                    "type": "function_call",
                    "id": f"fc_{digest}",
                    "call_id": f"call_{digest}",
                    "name": tools[0]["name"],
                    "arguments": json.dumps(_example_arguments(tools[0].get("parameters"))),
                    "status": "completed",
                }
            ]
        else:
            text = (
                f"The tool said: {results[-1].get('output')}"
                if results
                else "Hello! I am a fake OpenAI model."
            )
            output = [
                {
                    "type": "message",
                    "id": f"msg_{digest}",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        in_tokens, out_tokens = len(json.dumps(items)) // 4, len(json.dumps(output)) // 4
        result = {
            "id": f"resp_{digest}",
            "object": "response",
            "created_at": time.time(),
            "model": state.model,
            "status": "completed",
            "output": output,
            "usage": {
                "input_tokens": in_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": out_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": in_tokens + out_tokens,
            },
            "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"),
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "incomplete_details": None,
            "error": None,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
        }
        if body.get("stream") is True:
            return StreamingResponse(response_events(result), media_type="text/event-stream")
        return JSONResponse(result)

    @app.post("/_control")
    async def control(request: Request) -> dict[str, Any]:
        body = await request.json()
        with state.lock:
            if "fail_next" in body:
                state.fail_next = list(body["fail_next"])
            if "honor_token_ids" in body:
                state.honor_token_ids = bool(body["honor_token_ids"])
            if "return_token_ids" in body:
                state.return_token_ids = bool(body["return_token_ids"])
            if "scripts" in body:
                state.scripts.update(body["scripts"])
            if body.get("reset_calls"):
                state.counts.clear()
                state.requests.clear()
        return {"ok": True}

    @app.get("/_calls")
    async def calls() -> dict[str, Any]:
        with state.lock:
            return {"name": state.name, "counts": dict(state.counts), "requests": list(state.requests)}

    return app


# -- streaming (``stream: true``): the answer computed as above, sent the way vLLM / OpenAI send it ------

STREAM_PIECE = 4  # characters per content delta (about a token of this byte-level "model")
STREAM_PAUSE_S = 0.002  # between two deltas, so that a stream really is spread over time


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


async def chat_chunks(result: dict[str, Any], include_usage: bool, gen_ids: list[int] | None = None) -> Any:
    """vLLM's ``chat.completion.chunk`` stream of a complete chat answer (then ``data: [DONE]``).

    ``gen_ids`` (``return_token_ids``): as vLLM does, the first chunk carries ``prompt_token_ids`` and every
    chunk its share of the generated ids as ``token_ids`` (here: up to ``STREAM_PIECE`` per chunk, the rest
    on the finishing chunk), with the matching ``logprobs.content`` entries when log-probs were asked for."""
    choice = result["choices"][0]
    message = choice["message"]
    base = {k: result[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    entries = (choice.get("logprobs") or {}).get("content")
    sent = 0
    first = True

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        nonlocal sent, first
        data: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        head = {"prompt_token_ids": result["prompt_token_ids"]} if gen_ids is not None and first else {}
        first = False
        if gen_ids is not None:
            end = len(gen_ids) if finish is not None else min(len(gen_ids), sent + STREAM_PIECE)
            data["token_ids"] = gen_ids[sent:end]
            if entries is not None:
                data["logprobs"] = {"content": entries[sent:end]}
            sent = end
        return _sse({**base, **head, "choices": [data]})

    yield chunk({"role": "assistant", "content": ""})
    for field in ("reasoning_content", "content"):
        text = message.get(field) or ""
        for i in range(0, len(text), STREAM_PIECE):
            await asyncio.sleep(STREAM_PAUSE_S)
            yield chunk({field: text[i : i + STREAM_PIECE]})
    for index, call in enumerate(message.get("tool_calls") or []):
        head = {"index": index, "id": call["id"], "type": "function"}
        yield chunk(
            {"tool_calls": [{**head, "function": {"name": call["function"]["name"], "arguments": ""}}]}
        )
        args = call["function"]["arguments"]
        for i in range(0, len(args), STREAM_PIECE):
            await asyncio.sleep(STREAM_PAUSE_S)
            piece = {"index": index, "function": {"arguments": args[i : i + STREAM_PIECE]}}
            yield chunk({"tool_calls": [piece]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield _sse({**base, "choices": [], "usage": result["usage"]})
    yield b"data: [DONE]\n\n"


async def response_events(result: dict[str, Any]) -> Any:
    """OpenAI's Responses event stream of a complete response (messages and function calls)."""
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    yield event("response.created", response={**result, "status": "in_progress", "output": []})
    yield event("response.in_progress", response={**result, "status": "in_progress", "output": []})
    for index, item in enumerate(result["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index, item={**item, "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield event("response.content_part.added", **ids, part=part)
            for i in range(0, len(text), STREAM_PIECE):
                await asyncio.sleep(STREAM_PAUSE_S)
                yield event(
                    "response.output_text.delta", **ids, delta=text[i : i + STREAM_PIECE], logprobs=[]
                )
            yield event("response.output_text.done", **ids, text=text, logprobs=[])
            yield event("response.content_part.done", **ids, part={**part, "text": text})
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            ids = {"item_id": item["id"], "output_index": index}
            args = item["arguments"]
            for i in range(0, len(args), STREAM_PIECE):
                yield event("response.function_call_arguments.delta", **ids, delta=args[i : i + STREAM_PIECE])
            yield event("response.function_call_arguments.done", **ids, arguments=args)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=result)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (so a killed test run leaves nothing behind)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=loop, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, help="an already listening socket to serve on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="backend")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--reasoning-parser", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    state = _State(args.name, args.model, args.api_key, args.reasoning_parser, args.max_model_len)
    config = uvicorn.Config(
        build_app(state), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    if args.fd is not None:
        server.run(sockets=[socket.socket(fileno=args.fd)])
    else:
        server.run()


# ------------------------------------------------------------------------------------------------
# Starting one from a test.


class FakeBackend:
    """A fake backend process on 127.0.0.1 (context manager). ``url`` is its root; ``url + "/v1"`` is the API base."""

    def __init__(
        self,
        name: str = "backend",
        *,
        model: str = "fake-model",
        api_key: str | None = None,
        reasoning_parser: bool = False,
        max_model_len: int = 2048,
        ready_timeout_s: float = 60.0,
    ):
        self.name = name
        self._args = ["--name", name, "--model", model, "--max-model-len", str(max_model_len)]
        if api_key is not None:
            self._args += ["--api-key", api_key]
        if reasoning_parser:
            self._args.append("--reasoning-parser")
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._log = tempfile.NamedTemporaryFile(prefix=f"fake_vllm_{name}_", suffix=".log", delete=False)

    def start(self) -> FakeBackend:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        sock.set_inheritable(True)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--fd",
            str(sock.fileno()),
            "--parent-pid",
            str(os.getpid()),
        ]
        try:
            self.proc = subprocess.Popen(
                cmd + self._args,
                pass_fds=(sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        finally:
            sock.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"fake backend {self.name} did not start:\n{Path(self._log.name).read_text()[-3000:]}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> FakeBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def control(self, **body: Any) -> None:
        httpx.post(self.url + "/_control", json=body, timeout=10, trust_env=False).raise_for_status()

    def calls(self) -> dict[str, Any]:
        resp = httpx.get(self.url + "/_calls", timeout=10, trust_env=False)
        resp.raise_for_status()
        return resp.json()


if __name__ == "__main__":
    main()
