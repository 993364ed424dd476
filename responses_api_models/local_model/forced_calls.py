"""Forced tool calls: a llama.cpp grammar that only lets the model write valid calls.

Contract
--------
When a request forces a tool call (``tool_choice: "required"``, or a named function), local_model
decodes under a GBNF grammar (llama.cpp's grammar sampler), as vLLM's guided decoding does for the
same ``tool_choice`` values. The grammar admits exactly::

    <tool_call>
    {"name": "<offered name>", "arguments": <JSON valid for that tool's parameter schema>}
    </tool_call>

once (a named function, or ``parallel_tool_calls: false``) or one or more times separated by a
newline (``required``), then only the end of the turn. That is the Hermes/Qwen spelling, which
:mod:`tool_calls` parses whatever the model. The result: a call that parses and validates against
the tool's schema on every CPU, whatever the model would have preferred, so tests and users who
force a call never depend on a small model's free choice.

The log-probabilities the server reports stay those of the model's raw distribution (before the
grammar's mask), which is also vLLM's default (``raw_logprobs``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ForcedCallError", "forced_tool_names", "tool_call_grammar"]


class ForcedCallError(ValueError):
    """``tool_choice`` names a tool that is not offered, or forces a call with no tools."""


def forced_tool_names(tool_choice: Any, tools: list[dict[str, Any]] | None) -> list[str] | None:
    """The tools a call is forced to, or None when the model may answer freely.

    ``tools`` are Chat Completions tools (``{"type": "function", "function": {...}}``). Accepts the
    Responses spelling of a named function (``{"type": "function", "name": X}``) and the Chat one
    (``{"type": "function", "function": {"name": X}}``).
    """
    offered = [
        t["function"]["name"]
        for t in tools or []
        if t.get("type") == "function" and isinstance(t.get("function"), dict) and t["function"].get("name")
    ]
    if tool_choice == "required":
        if not offered:
            raise ForcedCallError('tool_choice "required" needs at least one function tool in `tools`')
        return offered
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ForcedCallError("tool_choice {type: function} must name the function (`name`)")
        if name not in offered:
            raise ForcedCallError(
                f"tool_choice names the function {name!r}, which is not in `tools` (offered: {offered})"
            )
        return [name]
    return None


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a GBNF string literal has JSON's escapes


def tool_call_grammar(tools: list[dict[str, Any]], names: list[str], *, several: bool) -> str:
    """GBNF source admitting tagged calls to ``names`` only, arguments valid for each schema.

    ``several``: one or more calls (a newline between them); otherwise exactly one.
    """
    from llama_cpp.llama_grammar import SchemaConverter

    by_name = {t["function"]["name"]: t["function"] for t in tools if isinstance(t.get("function"), dict)}
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    own: list[str] = []  # our rules, named apart from the converter's (args-*, space, string, ...)
    for index, name in enumerate(names):
        schema = by_name[name].get("parameters") or {"type": "object"}
        schema = converter.resolve_refs(json.loads(json.dumps(schema)), f"tool-{index}")
        args_rule = converter.visit(schema, f"args-{index}")
        head = _literal(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
        own.append(f'forced-call-{index} ::= {head} {args_rule} "}}"')
    own.append("forced-call ::= " + " | ".join(f"forced-call-{i}" for i in range(len(names))))
    one = r'"<tool_call>\n" forced-call "\n</tool_call>"'
    own.append(f'root ::= {one} ("\\n" {one})*' if several else f"root ::= {one}")
    return converter.format_grammar() + "\n" + "\n".join(own) + "\n"
