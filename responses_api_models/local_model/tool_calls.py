"""Turning a small model's raw completion text into (reasoning, content, tool calls).

Contract
--------
:func:`parse_completion` never raises and never invents content: every character of the input is
either returned as content/reasoning or consumed as (part of) a recognised tool call. Recognised
tool-call spellings, in order of precedence:

1. ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Qwen/Hermes format; the closing
   tag may be missing at the very end of the text). Any name is accepted here: a call to an unknown
   tool is still a call, and the agent tells the model that the tool does not exist.
2. Fenced JSON: a Markdown code block (optionally tagged ``json``) whose body is a call object or a
   list of them.
3. Bare call objects ``{"name": ..., "arguments": {...}}`` (or a list of them) when they are the
   whole message (as vLLM's ``llama3_json`` parser requires). A call object followed by other text
   or other JSON is prose: small models often write the call *and* an imagined result.

Formats 2 and 3 are only trusted when the name is one of the offered tools (so a model that prints
JSON data is not mistaken for a caller). ``parameters`` is accepted as a synonym of ``arguments``
(Llama-style). ``arguments`` is always returned as a JSON string; a string value is kept as it is
(the agent reports invalid JSON back to the model). ``<think>...</think>`` blocks become reasoning.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call)?[ \t]*\n(.*?)```", re.DOTALL)
_THINK_RE = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]+)"')
_DECODER = json.JSONDecoder()


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string (or the model's raw string when it sent one)


@dataclass
class ParsedCompletion:
    content: str
    reasoning: str | None = None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def _as_call(obj: Any, allowed: Collection[str] | None) -> ParsedToolCall | None:
    """``obj`` as a tool call if it looks like one (and names an allowed tool when ``allowed`` is given)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        return _as_call(obj["function"], allowed)
    extra = set(obj) - {"name", "arguments", "parameters", "type", "id"}
    if extra:
        return None
    name = obj["name"].strip()
    if allowed is not None and name not in allowed:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(name=name, arguments=arguments)


def _calls_from_json(value: Any, allowed: Collection[str] | None) -> list[ParsedToolCall] | None:
    """A call object or a non-empty list of call objects -> calls; anything else -> None."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = [_as_call(item, allowed) for item in items]
    if any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _parse_tagged_body(body: str) -> list[ParsedToolCall] | None:
    body = body.strip()
    if body.startswith("```"):  # a fence inside the tags
        body = re.sub(r"```\s*$", "", re.sub(r"^```[a-zA-Z_]*\s*", "", body)).strip()
    try:
        value, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        value, end = None, 0
    if value is not None and not body[end:].strip():
        calls = _calls_from_json(value, None)
        if calls:
            return calls
    # Last resort for a truncated/invalid body: keep the name, pass the rest on as raw arguments, so
    # the agent can tell the model its arguments are not valid JSON.
    m = _NAME_RE.search(body)
    if m:
        raw = body
        am = re.search(r'"(?:arguments|parameters)"\s*:\s*', body)
        if am:
            raw = body[am.end() :].rstrip()
            raw = raw[:-1].rstrip() if raw.endswith("}") and raw.count("{") < raw.count("}") else raw
        return [ParsedToolCall(name=m.group(1).strip(), arguments=raw)]
    return None


def _whole_text_calls(text: str, allowed: Collection[str]) -> list[ParsedToolCall] | None:
    """The calls when ``text`` is nothing but bare call objects (or a list of them); else None.

    Objects may be separated by whitespace, commas or semicolons. Any other text, or any JSON value
    that is not a call, means the message is prose (for example a call followed by the data the
    model imagines it returned), so nothing is taken as a call.
    """
    calls: list[ParsedToolCall] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] in ",;"):
            i += 1
        if i >= n:
            return calls or None
        if text[i] not in "{[":
            return None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        found = _calls_from_json(value, allowed)
        if not found:
            return None
        calls.extend(found)


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    out, last = [], 0
    for start, end in sorted(spans):
        out.append(text[last:start])
        last = end
    out.append(text[last:])
    return "".join(out)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``<think>...</think>`` blocks -> (reasoning or None, the rest)."""
    parts = [m.group(1).strip() for m in _THINK_RE.finditer(text)]
    if not parts:
        # Some templates open <think> in the prompt, so the completion only has the closing tag.
        if "</think>" in text:
            head, _, tail = text.partition("</think>")
            return head.strip() or None, tail
        return None, text
    return "\n\n".join(p for p in parts if p) or None, _THINK_RE.sub("", text)


def parse_completion(text: str, tool_names: Collection[str] | None) -> ParsedCompletion:
    """Split a completion into reasoning, content and tool calls.

    ``tool_names`` are the offered tools; ``None`` (no tools offered, or ``tool_choice: none``) means
    no tool-call parsing at all, so the text comes back as content unchanged (apart from reasoning).
    """
    reasoning, rest = split_reasoning(text)
    if tool_names is None:
        return ParsedCompletion(content=rest if reasoning is None else rest.strip(), reasoning=reasoning)
    allowed = set(tool_names)
    calls: list[ParsedToolCall] = []
    spans: list[tuple[int, int]] = []
    for m in _TOOL_CALL_RE.finditer(rest):
        found = _parse_tagged_body(m.group(1))
        if found:
            calls.extend(found)
            spans.append(m.span())
    if not calls:
        for m in _FENCE_RE.finditer(rest):
            body = m.group(1).strip()
            try:
                value, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                continue
            found = _calls_from_json(value, allowed) if not body[end:].strip() else None
            if found:
                calls.extend(found)
                spans.append(m.span())
    if not calls:
        calls = _whole_text_calls(rest, allowed) or []
        spans = [(0, len(rest))] if calls else []
    if not calls:
        return ParsedCompletion(content=rest if reasoning is None else rest.strip(), reasoning=reasoning)
    return ParsedCompletion(content=_cut(rest, spans).strip(), reasoning=reasoning, tool_calls=calls)
