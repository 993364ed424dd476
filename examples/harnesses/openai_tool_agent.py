"""A small agent harness on the official ``openai`` SDK, with a tool of its own: trained by harness_agent.

It knows nothing of NeMo Gym: it reads its task from stdin, talks to whatever model ``OPENAI_BASE_URL``
and ``OPENAI_API_KEY`` point at (``NG_MODEL`` names the model), runs the ``calculator`` tool itself
when the model asks for it, and prints the model's last answer. Run it by hand against any
OpenAI-compatible server:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... NG_MODEL=m python openai_tool_agent.py <<< "2+2?"
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "examples": ["2 + 3 * 4"]}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}
MAX_TURNS = 8


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or why it has none (never ``eval``)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
    model = os.environ.get("NG_MODEL", "model")
    max_tokens = int(os.environ.get("MAX_TOKENS", "512"))  # per answer
    streaming = os.environ.get("STREAM") == "1"  # ask for streamed answers
    messages: list[dict] = [{"role": "user", "content": sys.stdin.read()}]
    answer = ""
    for _ in range(MAX_TURNS):
        if streaming:  # the SDK's streaming helper; the final completion is assembled from the chunks
            with client.chat.completions.stream(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens
            ) as stream:
                for _event in stream:
                    pass
                reply = stream.get_final_completion()
        else:
            reply = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens
            )
        message = reply.choices[0].message
        answer = message.content or ""
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments or "{}").get("expression", "")
            except json.JSONDecodeError as e:
                expression, result = "", f"error: arguments are not JSON ({e})"
            else:
                result = (
                    calculate(expression) if call.function.name == "calculator" else "error: unknown tool"
                )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(answer)


if __name__ == "__main__":
    main()
