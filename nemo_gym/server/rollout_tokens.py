"""Exact token ids across the calls of one rollout, for clients that resend their history as plain text.

An agent harness (``harness_agent``, ``examples/harnesses/``) sends its whole conversation on every call,
as text: the model's earlier answers come back as strings and tool calls, not as the token ids the model
produced. Rendering and tokenising that text again need not give those ids (a tool call re-rendered by
the chat template, reasoning dropped by it, ``"_Ski" + "nny"`` re-tokenised as ``"_Skinny"``), so call
*k+1*'s prompt ids would not begin with call *k*'s prompt + generated ids, and the trainer's merged
multi-turn sample (:mod:`nemo_gym.kit.harness_trajectory`) would break at every call.

Contract
--------
* A model server that returns token ids (local_model, vllm_model with ``return_token_id_information``)
  remembers, for each call made under a rollout prefix (``/ng-rollout/<id>/``,
  :mod:`nemo_gym.server.rollout_prefix`), what the call's prompt rendered from (its chat messages and
  tools), the assistant turn it answered, and its exact prompt and generated ids
  (:meth:`RolloutTokenMemory.remember`).
* When a later call of the same rollout sends no token ids of its own, its last assistant message is
  the answer of a remembered call, and the messages before that answer (and the tools) are exactly what
  that call's prompt rendered from, :meth:`RolloutTokenMemory.attach` puts that call's
  ``prompt_token_ids`` / ``generation_token_ids`` on (a copy of) that assistant message. The model
  server then builds the prompt as those ids followed by the ids of only the new text after that turn
  (local_model: ``engine.LocalLLM.prompt_for``; vllm_model: the backend reads the ids from the message,
  as NeMo RL's vLLM server does). History that was rewritten (truncated, summarised, an answer edited)
  matches nothing: the prompt is tokenised afresh, and the trainer's merge starts a new sample there.
* Messages compare by role, text (an assistant's text without surrounding whitespace), tool calls (name
  and arguments compared as JSON) and tool-call ids of tool results; reasoning is not compared (a harness
  may drop it; the remembered ids keep the reasoning the model really generated).
* Bounded: at most ``max_calls_per_rollout`` calls per rollout (oldest first out), ``max_rollouts``
  rollouts and ``max_tokens`` ids in all (least recently used rollout first out). A rollout's calls are
  forgotten with its recorded model calls (``POST /ng_model_calls/pop``, :meth:`forget`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from nemo_gym.server.rollout_prefix import current_rollout_id

DEFAULT_MAX_ROLLOUTS = 4096
DEFAULT_MAX_CALLS_PER_ROLLOUT = 64
DEFAULT_MAX_TOKENS = 8_000_000
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


@dataclass(frozen=True, slots=True)
class RememberedCall:
    """One answered call: digests of its conversation and of its answer, and its exact ids."""

    history_key: bytes
    answer_key: bytes
    prompt_token_ids: list[int]
    generation_token_ids: list[int]

    @property
    def size(self) -> int:
        return len(self.prompt_token_ids) + len(self.generation_token_ids)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
                out.append(str(part.get("text", "")))
            else:  # an image, a file...: compared as it is
                out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(out)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS, default=str).decode()


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _tool_calls(message: dict[str, Any]) -> list[list[Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append([function.get("name"), _arguments(function.get("arguments"))])
    return calls


def _canonical(message: dict[str, Any]) -> list[Any]:
    role = message.get("role")
    role = "system" if role == "developer" else role
    text = _text(message.get("content"))
    if role == "assistant":
        return [role, text.strip(), _tool_calls(message)]
    if role == "tool":
        return [role, text, message.get("tool_call_id")]
    return [role, text]


def _digest(value: Any) -> bytes:
    data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.blake2b(data, digest_size=16).digest()


def history_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bytes:
    """The digest of a conversation and its tools, as a prompt renders from them."""
    return _digest([[_canonical(m) for m in messages if isinstance(m, dict)], tools or None])


def answer_key(message: dict[str, Any]) -> bytes:
    """The digest of an assistant turn (its text and tool calls)."""
    return _digest(_canonical({**message, "role": "assistant"}))


def carries_token_ids(messages: list[dict[str, Any]]) -> bool:
    """Whether an assistant message of the conversation already brings its own ids."""
    return any(
        isinstance(m, dict)
        and m.get("role") == "assistant"
        and m.get("prompt_token_ids")
        and m.get("generation_token_ids")
        for m in messages
    )


class RolloutTokenMemory:
    """The remembered calls of each rollout (see the module docstring); not thread-safe (event loop only)."""

    def __init__(
        self,
        max_rollouts: int = DEFAULT_MAX_ROLLOUTS,
        max_calls_per_rollout: int = DEFAULT_MAX_CALLS_PER_ROLLOUT,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if min(max_rollouts, max_calls_per_rollout, max_tokens) < 1:
            raise ValueError("the bounds of the rollout token memory must be >= 1")
        self.max_rollouts = max_rollouts
        self.max_calls_per_rollout = max_calls_per_rollout
        self.max_tokens = max_tokens
        self._by_rollout: OrderedDict[str, deque[RememberedCall]] = OrderedDict()
        self.tokens = 0
        self.reused = 0  # calls whose prompt was built on a remembered call's ids

    def __len__(self) -> int:
        return sum(len(calls) for calls in self._by_rollout.values())

    def remember(
        self,
        rollout_id: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        answer: dict[str, Any],
        prompt_token_ids: list[int],
        generation_token_ids: list[int],
    ) -> None:
        """Keep one answered call of ``rollout_id`` (nothing without a rollout id or without ids)."""
        if rollout_id is None or not prompt_token_ids or not generation_token_ids:
            return
        call = RememberedCall(
            history_key(messages, tools),
            answer_key(answer),
            [int(t) for t in prompt_token_ids],
            [int(t) for t in generation_token_ids],
        )
        if call.size > self.max_tokens:
            return
        calls = self._by_rollout.pop(rollout_id, None) or deque()
        self._by_rollout[rollout_id] = calls  # most recently used last
        calls.append(call)
        self.tokens += call.size
        while len(calls) > self.max_calls_per_rollout:
            self.tokens -= calls.popleft().size
        while len(self._by_rollout) > self.max_rollouts or self.tokens > self.max_tokens:
            oldest_id, oldest = next(iter(self._by_rollout.items()))
            if oldest_id == rollout_id and len(self._by_rollout) == 1:
                while self.tokens > self.max_tokens and len(oldest) > 1:
                    self.tokens -= oldest.popleft().size
                break
            del self._by_rollout[oldest_id]
            self.tokens -= sum(c.size for c in oldest)

    def match(
        self, rollout_id: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[int, RememberedCall] | None:
        """``(index of the last assistant message, the remembered call that produced it)``, or None."""
        calls = self._by_rollout.get(rollout_id) if rollout_id is not None else None
        if not calls:
            return None
        last = next(
            (
                i
                for i in range(len(messages) - 1, -1, -1)
                if isinstance(messages[i], dict) and messages[i].get("role") == "assistant"
            ),
            None,
        )
        if last is None:
            return None
        wanted_answer = answer_key(messages[last])
        wanted_history: bytes | None = None
        for call in reversed(calls):
            if call.answer_key != wanted_answer:
                continue
            if wanted_history is None:
                wanted_history = history_key(messages[:last], tools)
            if call.history_key == wanted_history:
                return last, call
        return None

    def attach(
        self, rollout_id: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """``messages`` with a remembered call's ids on its last assistant message (a copy), or
        ``messages`` itself when they carry ids already or nothing matches."""
        if rollout_id is None or carries_token_ids(messages):
            return messages
        found = self.match(rollout_id, messages, tools)
        if found is None:
            return messages
        last, call = found
        out = list(messages)
        out[last] = {
            **messages[last],
            "prompt_token_ids": list(call.prompt_token_ids),
            "generation_token_ids": list(call.generation_token_ids),
        }
        self.reused += 1
        return out

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop the remembered calls of ``rollout_ids`` (their recorded calls were handed out)."""
        for rid in rollout_ids:
            calls = self._by_rollout.pop(rid, None)
            if calls:
                self.tokens -= sum(c.size for c in calls)

    def stats(self) -> dict[str, int]:
        return {
            "rollouts": len(self._by_rollout),
            "calls": len(self),
            "tokens": self.tokens,
            "reused": self.reused,
        }


def rollout_for_token_reuse(enabled: bool) -> str | None:
    """The current request's rollout id when ids are returned (``enabled``), else None (nothing kept)."""
    return current_rollout_id() if enabled else None


def answer_of_output_items(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn a Responses answer's output items carry, as a chat message (text and tool calls),
    the way a client that sends the items back is read (:func:`answer_key`)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            texts.append(_text(item.get("content")))
        elif item.get("type") == "function_call":
            calls.append({"function": {"name": item.get("name"), "arguments": item.get("arguments")}})
    return {"role": "assistant", "content": "".join(texts), "tool_calls": calls}
