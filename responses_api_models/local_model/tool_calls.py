"""Turning a small model's raw completion text into (reasoning, content, tool calls).

Contract
--------
:func:`parse_completion` never raises and never invents content: every character of the input is
either returned as content/reasoning or consumed as (part of) a recognised tool call. Recognised
tool-call spellings, in order of precedence:

1. ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Qwen/Hermes format; the closing
   tag may be missing at the very end of the text). Any name is accepted here: a call to an unknown
   tool is still a call, and the agent tells the model that the tool does not exist.
   ``<tools>...</tools>`` (the prompt's tag for tool definitions, which small models copy) is read
   the same way, but only for offered names.
2. Fenced JSON: a Markdown code block (optionally tagged ``json``) whose body is a call object or a
   list of them.
3. Bare call objects ``{"name": ..., "arguments": {...}}`` (or lists of them) that end the message,
   the first starting a line (small models often write one call per line), optionally after a
   lead-in sentence, which becomes the content. A call object followed by other text or other JSON
   is prose: small models often write the call *and* an imagined result.

A call cut off by the end of the text (the token budget ran out inside it: tagged, fenced or bare)
is still returned, with ``complete=False`` and the raw partial arguments, so the server reports an
incomplete ``function_call`` instead of passing the fragment off as an answer.

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
# Qwen2.5-Coder-1.5B often wraps its call in the prompt's <tools> tag instead of <tool_call>.
_TOOLS_TAG_RE = re.compile(r"<tools>(.*?)(?:</tools>|\Z)", re.DOTALL)
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_THINK_RE = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]+)"')
_DECODER = json.JSONDecoder()


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string (or the model's raw string when it sent one)
    complete: bool = True  # False: the text ended inside this call (cut off by the token budget)


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


def _partial_call(body: str, allowed: Collection[str] | None) -> ParsedToolCall | None:
    """A call object cut off mid-way (``{"name": "x", "arguments": {"a": ...``), or None.

    The name must be complete (and offered, when ``allowed`` is given); the arguments are passed on
    raw, so the agent tells the model they are not valid JSON instead of losing the attempt.
    """
    m = _NAME_RE.search(body)
    if not m or (allowed is not None and m.group(1).strip() not in allowed):
        return None
    raw = body
    am = re.search(r'"(?:arguments|parameters)"\s*:\s*', body)
    if am:
        raw = body[am.end() :].rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") and raw.count("{") < raw.count("}") else raw
    return ParsedToolCall(name=m.group(1).strip(), arguments=raw, complete=False)


def _parse_tagged_body(
    body: str, at_end: bool, allowed: Collection[str] | None = None
) -> list[ParsedToolCall] | None:
    """The calls inside one ``<tool_call>`` tag; ``at_end``: the tag was never closed (text ended).

    ``allowed``: only calls to these names count (None: any name, the ``<tool_call>`` rule).
    """
    body = body.strip()
    if body.startswith("```"):  # a fence inside the tags
        body = re.sub(r"```\s*$", "", re.sub(r"^```[a-zA-Z_]*\s*", "", body)).strip()
    try:
        value, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        value, end = None, 0
    if value is not None and not body[end:].strip():
        calls = _calls_from_json(value, allowed)
        if calls:
            return calls
    if allowed is not None and not (at_end and _unterminated(body)):
        return None
    # A truncated/invalid body: keep the name, pass the rest on as raw arguments, so the agent can
    # tell the model its arguments are not valid JSON.
    call = _partial_call(body, allowed)
    if call is None:
        return None
    call.complete = not at_end
    return [call]


def _trailing_calls(text: str, allowed: Collection[str]) -> tuple[int, list[ParsedToolCall]] | None:
    """Bare call objects that end ``text``: (where they start, the calls), or None.

    The calls start a line and run to the end of the text, separated by whitespace, commas or
    semicolons; what comes before them is the lead-in (content). Any other text or JSON value after
    the first call, such as the data a model imagines the call returned, makes the whole message
    prose. A last object cut off by the end of the text counts as an incomplete call.
    """
    for m in re.finditer(r"^[ \t]*(?=[{\[])", text, re.MULTILINE):
        lead = text[: m.start()]
        if "{" in lead:  # earlier JSON: not a lead-in sentence
            return None
        calls: list[ParsedToolCall] = []
        i, n = m.end(), len(text)
        while True:
            while i < n and (text[i].isspace() or text[i] in ",;"):
                i += 1
            if i >= n:
                return (m.start(), calls) if calls else None
            if text[i] not in "{[":
                break
            try:
                value, i = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                partial = _partial_call(text[i:], allowed) if text[i] == "{" else None
                if partial is not None and _unterminated(text[i:]):
                    return m.start(), [*calls, partial]
                break
            found = _calls_from_json(value, allowed)
            if not found:
                break
            calls.extend(found)
        return None
    return None


def _unterminated(fragment: str) -> bool:
    """True when ``fragment`` is JSON that stopped before its objects/arrays/strings were closed."""
    depth, in_string, escaped = 0, False, False
    for ch in fragment:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return depth > 0


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
        found = _parse_tagged_body(m.group(1), at_end=not m.group(0).endswith("</tool_call>"))
        if found:
            calls.extend(found)
            spans.append(m.span())
    if not calls:
        for m in _TOOLS_TAG_RE.finditer(rest):
            found = _parse_tagged_body(m.group(1), not m.group(0).endswith("</tools>"), allowed)
            if found:
                calls.extend(found)
                spans.append(m.span())
    if not calls:
        for m in _FENCE_RE.finditer(rest):
            body = m.group(1).strip()
            closed = m.group(0).endswith("```") and len(m.group(0)) > 3
            try:
                value, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                partial = None if closed or not _unterminated(body) else _partial_call(body, allowed)
                if partial is not None:
                    calls.append(partial)
                    spans.append(m.span())
                continue
            found = _calls_from_json(value, allowed) if not body[end:].strip() else None
            if found:
                calls.extend(found)
                spans.append(m.span())
    if not calls:
        trailing = _trailing_calls(rest, allowed)
        if trailing is not None:
            start, calls = trailing
            spans = [(start, len(rest))]
    if not calls:
        return ParsedCompletion(content=rest if reasoning is None else rest.strip(), reasoning=reasoning)
    return ParsedCompletion(content=_cut(rest, spans).strip(), reasoning=reasoning, tool_calls=calls)
