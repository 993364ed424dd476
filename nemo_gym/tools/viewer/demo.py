"""Synthetic rollouts files in ``ng_collect_rollouts``' output format, for the benchmark and screenshots.

``python -m nemo_gym.tools.viewer.demo <out.jsonl> [--tasks N] [--repeats K] [--row-bytes B] [--seed S]``
writes ``N*K`` rollouts of a made-up "travel desk" environment: a developer prompt, a user
question, reasoning, one to four tool calls (weather, currency, document search) with outputs —
some of them errors — a final answer, a verify result with ``reward`` and task fields, usage, and
``_ng_task_index`` / ``_ng_rollout_index`` / ``agent_ref``. ``--row-bytes`` pads the tool outputs
so each line is about that long (10,700 bytes gives a 1 GB file for 100,000 rollouts). Output is
deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

CITIES = [
    "Paris",
    "Lagos",
    "Osaka",
    "Lima",
    "Oslo",
    "Perth",
    "Quito",
    "Dakar",
    "Hanoi",
    "Tunis",
    "Porto",
    "Cusco",
]
CURRENCIES = ["EUR", "USD", "JPY", "NGN", "PEN", "NOK", "AUD", "XOF", "VND", "TND"]
WORDS = (
    "the a to of and in that it is for on with as was at by this from be have or an are not but which "
    "train station museum harbour market river bridge ticket schedule platform weather forecast rain sun "
    "wind humidity temperature currency rate exchange budget hotel night breakfast itinerary visa border "
    "flight delay luggage taxi ferry walking tour guide district old town cathedral garden square festival "
    "local dish price average range season peak quiet crowded early late morning evening weekend holiday"
).split()
AGENTS = ["travel_desk_simple_agent", "travel_desk_react_agent"]

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather and a three-day forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "convert_currency",
        "description": "Convert an amount between two ISO 4217 currencies at today's rate.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from": {"type": "string"},
                "to": {"type": "string"},
            },
            "required": ["amount", "from", "to"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "search_guides",
        "description": "Full-text search over travel guides; returns the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 3}},
            "required": ["query"],
            "additionalProperties": False,
        },
        "strict": True,
    },
]


def _paragraphs(rng: random.Random, n: int, words: int) -> list[str]:
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(text[0].upper() + text[1:] + ".")
    return out


class DemoRollouts:
    """Deterministic generator of demo rollouts."""

    def __init__(self, seed: int = 0, row_bytes: int = 3000) -> None:
        self.rng = random.Random(seed)
        self.row_bytes = row_bytes
        self.pool = _paragraphs(self.rng, 400, 60)

    def _passage(self, n_chars: int) -> str:
        parts: list[str] = []
        total = 0
        while total < n_chars:
            p = self.rng.choice(self.pool)
            parts.append(p)
            total += len(p) + 1
        return " ".join(parts)[: max(0, n_chars)]

    def task(self, task_index: int) -> dict[str, Any]:
        """The task fields of task ``task_index`` (same for every rollout of it)."""
        r = random.Random(task_index * 7919 + 17)
        city = r.choice(CITIES)
        cur = r.choice(CURRENCIES)
        amount = r.choice([50, 120, 300, 999, 1500])
        question = (
            f"I'm planning a trip to {city} next week with a budget of {amount} USD. "
            f"What's the weather going to be like, how much is that in {cur}, and what should I see first? "
            f"(booking ref TRV-{task_index:06d})"
        )
        return {"city": city, "currency": cur, "amount": amount, "question": question}

    def rollout(self, task_index: int, rollout_index: int) -> dict[str, Any]:
        """One rollout object as ``ng_collect_rollouts`` writes it."""
        rng = self.rng
        t = self.task(task_index)
        n_id = f"{task_index:06d}{rollout_index:02d}"
        calls: list[tuple[str, dict[str, Any], str]] = []
        n_calls = rng.choice([1, 2, 2, 3, 3, 4])
        error_call = rng.random() < 0.12
        for k in range(n_calls):
            tool = ["get_weather", "convert_currency", "search_guides", "search_guides"][k % 4]
            if tool == "get_weather":
                args: dict[str, Any] = {"city": t["city"] if rng.random() > 0.15 else "example", "days": 3}
                out = orjson.dumps(
                    {
                        "city": args["city"],
                        "now": f"{rng.choice(['rainy', 'sunny', 'windy', 'cloudy'])}, {rng.randint(-3, 34)} degrees Celsius",
                        "forecast": [
                            f"day {d + 1}: {rng.choice(['rain', 'sun', 'clouds'])}" for d in range(3)
                        ],
                    }
                ).decode()
            elif tool == "convert_currency":
                args = {"amount": t["amount"], "from": "USD", "to": t["currency"]}
                out = orjson.dumps(
                    {
                        "amount": round(t["amount"] * rng.uniform(0.5, 2000), 2),
                        "currency": t["currency"],
                        "rate_date": "2025-05-02",
                    }
                ).decode()
            else:
                args = {"query": f"first things to see in {t['city']}", "top_k": 3}
                out = orjson.dumps(
                    {
                        "passages": [
                            {
                                "guide": f"{t['city']} in three days",
                                "text": self._passage(rng.randint(120, 260)),
                            }
                            for _ in range(3)
                        ]
                    }
                ).decode()
            if error_call and k == n_calls - 1:
                out = f"Error: tool {tool!r} failed: TimeoutError: upstream guide service did not answer in 10 s"
            calls.append((tool, args, out))
        answer_ok = rng.random() < 0.55
        answer = (
            f"Here is your plan for {t['city'] if answer_ok else 'the city'}: expect mixed weather, "
            f"your {t['amount']} USD is about the converted amount in {t['currency']}, and start with the old town."
        )
        reward = 1.0 if answer_ok and not error_call else rng.choice([0.0, 0.0, 0.5])
        reasoning = (
            f"The user wants weather, currency and sights for {t['city']}. I should call get_weather first, "
            f"then convert {t['amount']} USD to {t['currency']}, then search the guides."
        )
        output: list[dict[str, Any]] = [
            {
                "type": "reasoning",
                "id": f"rs_{n_id}",
                "summary": [{"type": "summary_text", "text": reasoning}],
            }
        ]
        for k, (tool, args, out) in enumerate(calls):
            cid = f"call_{n_id}_{k}"
            output.append(
                {
                    "type": "function_call",
                    "call_id": cid,
                    "name": tool,
                    "arguments": orjson.dumps(args).decode(),
                    "id": f"fc_{n_id}_{k}",
                    "status": "completed",
                }
            )
            output.append(
                {
                    "type": "function_call_output",
                    "call_id": cid,
                    "output": out,
                    "id": f"fco_{n_id}_{k}",
                    "status": "completed",
                }
            )
        output.append(
            {
                "type": "message",
                "role": "assistant",
                "id": f"msg_{n_id}",
                "status": "completed",
                "content": [{"type": "output_text", "text": answer, "annotations": []}],
            }
        )
        row: dict[str, Any] = {
            "responses_create_params": {
                "input": [
                    {
                        "type": "message",
                        "role": "developer",
                        "content": "You are a travel desk assistant. Use the tools before answering; never guess prices.",
                    },
                    {"type": "message", "role": "user", "content": t["question"]},
                ],
                "tools": TOOLS,
                "temperature": 0.7,
                "top_p": 0.95,
                "max_output_tokens": 2048,
                "seed": rollout_index,
            },
            "response": {
                "id": f"resp_{n_id}",
                "object": "response",
                "created_at": 1746172800.0 + task_index,
                "model": "demo-policy-8b",
                "status": "completed",
                "output": output,
                "usage": {
                    "input_tokens": 0,
                    "output_tokens": 0,
                    "total_tokens": 0,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": len(reasoning) // 4},
                },
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "temperature": 0.7,
                "top_p": 0.95,
                "max_output_tokens": 2048,
                "instructions": None,
                "metadata": None,
                "incomplete_details": None,
                "error": None,
            },
            "reward": reward,
            "expected_city": t["city"],
            "expected_currency": t["currency"],
            "judge_notes": "mentions the city and currency"
            if reward == 1.0
            else "answer does not name the city or a tool failed",
            "agent_ref": {
                "type": "responses_api_agents",
                "name": AGENTS[task_index % len(AGENTS)] if task_index % 5 == 4 else AGENTS[0],
            },
            "_ng_task_index": task_index,
            "_ng_rollout_index": rollout_index,
        }
        size = len(orjson.dumps(row))
        pad = self.row_bytes - size
        search_outputs = [
            it
            for it in output
            if it["type"] == "function_call_output" and it["output"].startswith('{"passages"')
        ]
        if pad > 0 and search_outputs:
            target = search_outputs[0]
            obj = orjson.loads(target["output"])
            share = max(0, (pad - 40) // len(obj["passages"]))
            for p in obj["passages"]:
                p["text"] += " " + self._passage(share)
            target["output"] = orjson.dumps(obj).decode()
        elif pad > 0:  # no search call: the weather service's advisory text carries the padding
            target = next(it for it in output if it["type"] == "function_call_output")
            if target["output"].startswith("{"):
                obj = orjson.loads(target["output"])
                obj["advisory"] = self._passage(pad - 20)
                target["output"] = orjson.dumps(obj).decode()
        out_tokens = sum(len(str(it)) for it in output) // 4
        in_tokens = len(t["question"]) // 4 + 400 + 300 * n_calls
        row["response"]["usage"].update(
            input_tokens=in_tokens, output_tokens=out_tokens, total_tokens=in_tokens + out_tokens
        )
        return row

    def rows(self, n_tasks: int, repeats: int) -> Iterator[dict[str, Any]]:
        """All rollouts, task-major (as ``ng_collect_rollouts`` orders its input)."""
        for task in range(n_tasks):
            for r in range(repeats):
                yield self.rollout(task, r)


def write_demo(
    path: str | Path,
    n_tasks: int,
    repeats: int,
    row_bytes: int = 3000,
    seed: int = 0,
    malformed_lines: tuple[int, ...] = (),
) -> int:
    """Write a demo rollouts file; ``malformed_lines`` (1-based) are replaced by broken JSON. Returns bytes written."""
    gen = DemoRollouts(seed=seed, row_bytes=row_bytes)
    bad = set(malformed_lines)
    written = 0
    with open(path, "wb", buffering=8 << 20) as f:
        for line_no, row in enumerate(gen.rows(n_tasks, repeats), start=1):
            data = orjson.dumps(row)
            if line_no in bad:
                data = data[: len(data) // 3]  # cut mid-object, like a crashed writer
            f.write(data + b"\n")
            written += len(data) + 1
    return written


def main(argv: list[str] | None = None) -> None:
    """Command line: write a demo rollouts file."""
    ap = argparse.ArgumentParser(description="Write a synthetic rollouts file for trying ng_viewer.")
    ap.add_argument("out")
    ap.add_argument("--tasks", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--row-bytes", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = write_demo(args.out, args.tasks, args.repeats, args.row_bytes, args.seed)
    print(f"wrote {args.tasks * args.repeats} rollouts, {n} bytes, to {args.out}")


if __name__ == "__main__":
    main()
