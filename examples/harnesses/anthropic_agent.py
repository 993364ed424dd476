"""A small agent harness on the official ``anthropic`` SDK: trained by harness_agent.

It reads its task from stdin, talks to whatever server ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``
point at (``NG_MODEL`` names the model) through the Messages API, runs its ``calculator`` tool itself,
and prints the model's last text.
"""

from __future__ import annotations

import os
import sys

from anthropic import Anthropic
from openai_tool_agent import MAX_TURNS, calculate  # the same tool, next to this file

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string", "examples": ["2 + 3 * 4"]}},
            "required": ["expression"],
        },
    }
]


def main() -> None:
    client = Anthropic()  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY from the environment
    model = os.environ.get("NG_MODEL", "model")
    messages: list[dict] = [{"role": "user", "content": sys.stdin.read()}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.messages.create(
            model=model, max_tokens=int(os.environ.get("MAX_TOKENS", "512")), messages=messages, tools=TOOLS
        )
        answer = "".join(block.text for block in reply.content if block.type == "text")
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
        )
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        results = []
        for use in uses:
            expression = use.input.get("expression", "") if isinstance(use.input, dict) else ""
            result = calculate(expression) if use.name == "calculator" else "error: unknown tool"
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages.append({"role": "user", "content": results})
    print(answer)


if __name__ == "__main__":
    main()
