"""``ng_bench +suite=streaming``: what ``stream: true`` costs, and how soon a streamed answer starts.

Contract
--------
* :func:`measure_scripted` starts the scripted model (``ng_run``'s machinery, real HTTP on 127.0.0.1) and
  sends the same requests plain and streamed (every event read to the end), per API, ``requests`` each,
  ``concurrency`` at a time, in alternating rounds (so a change of load on the machine hits both alike).
  Per API: requests/s of each, and ``stream_cost_pct``, how much longer a streamed request takes than a
  plain one (the aim: under 15 %).
* :func:`measure_local_ttft` (when the default local model is installed) sends ``requests`` streamed
  chat requests one at a time (``max_tokens`` each) and reports the median time to the first content
  delta, the median total time and their ratio; and the plain request's median total time beside them.
* Nothing is asserted: the command prints the figures and writes ``+output_json_fpath``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from nemo_gym.auth import client_token_for_url

SCRIPTED_BODIES = {
    "responses": ("/v1/responses", {"input": [{"role": "user", "content": "What is the weather in Paris?"}]}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "What is the weather in Paris?"}]},
    ),
}
LOCAL_PROMPT = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], stream: bool) -> int:
    """One request read to its end; returns the bytes received."""
    if not stream:
        r = await client.post(url, json=body)
        r.raise_for_status()
        return len(r.content)
    received = 0
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            received += len(chunk)
    return received


async def _round(
    base: str, path: str, body: dict[str, Any], stream: bool, requests: int, concurrency: int
) -> float:
    """Seconds to send ``requests`` requests, ``concurrency`` at a time."""
    headers = {"Authorization": f"Bearer {client_token_for_url(base)}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60.0, trust_env=False) as client:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await _one(client, base + path, body, stream)

        await _one(client, base + path, body, stream)  # warm the connection
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def measure_scripted(requests: int = 2000, concurrency: int = 16, rounds: int = 3) -> dict[str, Any]:
    from nemo_gym.tools.testing import running_servers, server_url

    out: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "rounds": rounds}
    with running_servers([]) as helper:
        base = server_url(helper, "policy_model")
        for api, (path, body) in SCRIPTED_BODIES.items():
            plain: list[float] = []
            streamed: list[float] = []
            for i in range(rounds):
                order = (False, True) if i % 2 == 0 else (True, False)
                for stream in order:
                    elapsed = asyncio.run(_round(base, path, body, stream, requests, concurrency))
                    (streamed if stream else plain).append(elapsed)
            plain_s, streamed_s = statistics.median(plain), statistics.median(streamed)
            out[api] = {
                "plain_requests_per_s": round(requests / plain_s, 1),
                "streamed_requests_per_s": round(requests / streamed_s, 1),
                "stream_cost_pct": round(100.0 * (streamed_s / plain_s - 1.0), 1),
            }
    return out


def measure_local_ttft(requests: int = 5, max_tokens: int = 64) -> dict[str, Any]:
    from nemo_gym.tools.testing import running_servers, server_url
    from responses_api_models.local_model import weights

    missing = weights.default_model_unavailable()
    if missing is not None:
        return {"skipped": f"needs the default local model: {missing}"}
    config = "responses_api_models/local_model/configs/local_model.yaml"
    first: list[float] = []
    totals: list[float] = []
    plain: list[float] = []
    with running_servers([config], with_scripted_model=False) as helper:
        base = server_url(helper, "policy_model")
        headers = {"Authorization": f"Bearer {client_token_for_url(base)}"}
        body = {"messages": LOCAL_PROMPT, "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(headers=headers, timeout=300.0, trust_env=False) as client:
            client.post(base + "/v1/chat/completions", json={**body, "max_tokens": 2})  # warm up
            for _ in range(requests):
                t0 = time.perf_counter()
                seen: float | None = None
                with client.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if seen is None and line.startswith("data: {") and '"content":"' in line:
                            if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                                seen = time.perf_counter() - t0
                totals.append(time.perf_counter() - t0)
                first.append(seen if seen is not None else totals[-1])
                t0 = time.perf_counter()
                client.post(base + "/v1/chat/completions", json=body).raise_for_status()
                plain.append(time.perf_counter() - t0)
    ttft, total = statistics.median(first), statistics.median(totals)
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "time_to_first_token_s": round(ttft, 3),
        "streamed_total_s": round(total, 3),
        "first_token_fraction": round(ttft / total, 3),
        "plain_total_s": round(statistics.median(plain), 3),
    }


def run_suite(cfg: dict[str, Any]) -> dict[str, Any]:
    requests = int(cfg.get("requests", 2000))
    concurrency = int(cfg.get("concurrency", 16))
    rounds = int(cfg.get("rounds", 3))
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "scripted": measure_scripted(requests, concurrency, rounds),
    }
    if bool(cfg.get("local", True)):
        result["local_model"] = measure_local_ttft(
            int(cfg.get("local_requests", 5)), int(cfg.get("max_tokens", 64))
        )
    print(format_report(result))
    out = cfg.get("output_json_fpath")
    if out:
        Path(str(out)).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_report(result: dict[str, Any]) -> str:
    lines = ["streaming benchmark"]
    scripted = result["scripted"]
    for api in SCRIPTED_BODIES:
        row = scripted[api]
        lines.append(
            f"  scripted {api:9s}: plain {row['plain_requests_per_s']:8.1f} req/s, streamed "
            f"{row['streamed_requests_per_s']:8.1f} req/s, stream cost {row['stream_cost_pct']:+.1f} % "
            f"per request (aim < 15 %)"
        )
    local = result.get("local_model")
    if local and "skipped" not in local:
        lines.append(
            f"  local_model chat: first token after {local['time_to_first_token_s']:.3f} s of "
            f"{local['streamed_total_s']:.3f} s ({100 * local['first_token_fraction']:.0f} %), "
            f"plain answer {local['plain_total_s']:.3f} s ({local['max_tokens']} tokens)"
        )
    elif local:
        lines.append(f"  local_model: {local['skipped']}")
    return "\n".join(lines)
