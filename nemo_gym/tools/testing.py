"""Helpers for tests that start real servers on 127.0.0.1 (used by the project's and environments' tests).

``running_servers(config_paths, overrides)`` starts a run through :class:`nemo_gym.cli.RunHelper`
with the head server on a free port (so tests can run side by side) and stops it afterwards.
``post_json`` / ``run_rollout`` talk real HTTP to the started servers. ``numeric_differences`` compares
generated data with stored data number by number, within a tolerance (floating-point results differ in
their last digits between CPUs). ``refusing_port()`` is a port that refuses every connection.
"""

from __future__ import annotations

import contextlib
import copy
import math
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from nemo_gym.auth import TRAINER_TOKEN_HEADER_NAME, auth_headers, client_token_for_url, trainer_token
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.parser import GlobalConfigDictParserConfig
from nemo_gym.config.types import POLICY_VERSION_PATH
from nemo_gym.run.cli import RunHelper

SCRIPTED_MODEL_CONFIG = "responses_api_models/scripted_model/configs/scripted_model.yaml"
_REFUSING_SOCKETS: list[socket.socket] = []


def refusing_port() -> int:
    """A port of 127.0.0.1 that refuses every connection for the rest of this process: bound by it and
    never listened on. (A port bound and released is free for anyone: on a machine running tests side by
    side, another test's server took one, and the "unreachable" endpoint answered 401.)"""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _REFUSING_SOCKETS.append(sock)
    return sock.getsockname()[1]


# The get_weather tool of example_single_tool_call, as a Responses API tool and as a Chat Completions tool.
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER_CHAT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"},
}


def weather_row(city: str, agent: str | None = None) -> dict[str, Any]:
    """A task row of the example_single_tool_call kind: ask for ``city``'s weather with ``WEATHER_TOOL``
    offered (``agent``: the row's ``agent_ref``, for a collection across agents)."""
    row: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"What's the weather in {city}?"}],
            "tools": [WEATHER_TOOL],
        },
        "expected_city": city,
    }
    if agent is not None:
        row["agent_ref"] = {"name": agent}
    return row


@contextlib.contextmanager
def running_servers(
    config_paths: list[str], extra_config: dict[str, Any] | None = None, with_scripted_model: bool = True
) -> Iterator[RunHelper]:
    paths = list(config_paths) + ([SCRIPTED_MODEL_CONFIG] if with_scripted_model else [])
    initial: dict[str, Any] = {"config_paths": paths, "head_server": {"host": "127.0.0.1", "port": 0}}
    helper = RunHelper()
    try:
        helper.start(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=_deep_merge(initial, extra_config or {}),
                skip_load_from_cli=True,
                skip_load_from_env_yaml=True,
            )
        )
        yield helper
    finally:
        helper.shutdown()


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def server_url(helper: RunHelper, name: str) -> str:
    for row in helper.server_instances():
        if row["name"] == name:
            return row["url"]
    raise KeyError(f"no server {name!r}; have {[r['name'] for r in helper.server_instances()]}")


def post_json(
    url: str, body: Any, cookies: dict[str, str] | None = None, timeout: float = 60, token: str | None = None
) -> httpx.Response:
    """POST ``body`` as JSON with the run ``token`` (default: that of the run this process started
    that serves ``url``); to ``/policy_version``, with the run's trainer credential as well, as
    :class:`nemo_gym.client.server_client.ServerClient` sends it."""
    headers = {"content-type": "application/json", **auth_headers(token or client_token_for_url(url))}
    if urlsplit(url).path.endswith(POLICY_VERSION_PATH):
        trainer = trainer_token(urlsplit(url).port)
        if trainer:
            headers[TRAINER_TOKEN_HEADER_NAME] = trainer
    return httpx.post(
        url, content=orjson.dumps(body), headers=headers, cookies=cookies, timeout=timeout, trust_env=False
    )


def get(url: str, timeout: float = 10) -> httpx.Response:
    """GET ``url`` from a server of a run this process started, with that run's token."""
    return httpx.get(url, headers=auth_headers(client_token_for_url(url)), timeout=timeout, trust_env=False)


def run_rollout(
    helper: RunHelper, agent_name: str, row: dict[str, Any], timeout: float = 60
) -> dict[str, Any]:
    """POST one task row to an agent's /run; asserts a 200 and returns the JSON body."""
    resp = post_json(server_url(helper, agent_name) + "/run", row, timeout=timeout)
    assert resp.status_code == 200, f"/run answered {resp.status_code}: {resp.text[:2000]}"
    return resp.json()


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(url: str, token: str | None = None) -> Samples:
    """``GET <url>/metrics`` (with the run token) -> sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(
        url + "/metrics",
        headers=auth_headers(token or client_token_for_url(url)),
        timeout=10,
        trust_env=False,
    )
    assert resp.status_code == 200, resp.text[:500]
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def metric_value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for ls, v in samples.get(name, []) if all(ls.get(k) == x for k, x in labels.items()))


def numeric_differences(
    got: Any, want: Any, *, rel_tol: float, abs_tol: float = 0.0, path: str = "", limit: int = 10
) -> list[str]:
    """Where ``got`` and ``want`` (JSON-like data: dicts, lists, numbers, text) differ, at most ``limit``
    places (``[]``: they agree). Floats agree within ``math.isclose(rel_tol, abs_tol)``: a generator's
    floating-point results differ in their last digits between CPUs (BLAS kernels, SIMD paths), so data
    generated on one machine is compared with stored data by value, not by bytes. Everything else (keys,
    lengths, text, integers, booleans, types) must be equal."""
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                out.append(f"{where or '(top)'}: keys {sorted(a)} != {sorted(b)}")
                return
            for key in a:
                walk(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
            if len(a) != len(b):
                out.append(f"{where or '(top)'}: {len(a)} items != {len(b)}")
                return
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(x, y, f"{where}[{i}]")
        elif isinstance(a, float) and isinstance(b, float):
            if not math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol):
                out.append(
                    f"{where or '(top)'}: {a!r} != {b!r} (relative difference {abs(a - b) / max(abs(a), abs(b)):.3g})"
                )
        elif type(a) is not type(b) or a != b:
            out.append(f"{where or '(top)'}: {str(a)[:80]!r} != {str(b)[:80]!r}")

    walk(got, want, path)
    return out


def example_rows(env_folder: str) -> list[dict[str, Any]]:
    relative = Path("resources_servers") / env_folder / "data" / "example.jsonl"
    path = relative if relative.is_file() else PACKAGE_PARENT_DIR / relative
    return [orjson.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def collect_rollouts(
    helper: RunHelper, rows: list[dict[str, Any]], workdir: Path, agent_name: str, *extra_args: str
) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``ng_collect_rollouts`` (its entry point, in this process) on ``rows`` against the run of
    ``helper``; returns (exit status, the output rows in input order, what it printed to stderr)."""
    import contextlib as _contextlib
    import io

    from nemo_gym.collection.cli import collect_main

    workdir.mkdir(parents=True, exist_ok=True)
    inputs, output = workdir / "input.jsonl", workdir / "output.jsonl"
    inputs.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    argv = [
        f"+input_jsonl_fpath={inputs}",
        f"+output_jsonl_fpath={output}",
        f"+agent_name={agent_name}",
        "+progress=false",
        f"+head_server.port={helper.head_server_config.port}",
        *extra_args,
    ]
    err = io.StringIO()
    code = 0
    with _contextlib.redirect_stderr(err):
        try:
            collect_main(argv)
        except SystemExit as e:
            code = int(e.code or 0) if not isinstance(e.code, str) else 1
    out = [orjson.loads(line) for line in output.read_bytes().splitlines()] if output.exists() else []
    out.sort(key=lambda r: (r.get("_ng_task_index", 0), r.get("_ng_rollout_index", 0)))
    return code, out, err.getvalue()


def text_response(text: str) -> dict[str, Any]:
    """A Responses API response (as JSON) whose one assistant message says ``text``, with no ``status``
    key (as upstream's recorded rollouts store one): the ``response`` of a ``/verify`` body in tests."""
    return {
        "id": "resp_1",
        "created_at": 1.0,
        "model": "m",
        "object": "response",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
            }
        ],
    }


def variant_tag(variant: str, index: int) -> str:
    """The marker that selects a scripted trajectory for one row: ``[variant=<variant> row=<index>]``."""
    return f"[variant={variant} row={index}]"


def tagged_row(row: dict[str, Any], variant: str, index: int) -> dict[str, Any]:
    """A copy of ``row`` whose last input message ends with :func:`variant_tag`, so that the scripted
    model's ``scripts_by_input`` rule for that tag (:func:`variant_rules`) plays its trajectory."""
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {variant_tag(variant, index)}"
    return out


def variant_rules(
    rows: list[dict[str, Any]], variants: Callable[[dict[str, Any]], dict[str, list[dict[str, Any]]]]
) -> list[dict[str, Any]]:
    """``scripts_by_input`` rules: for each row (by index) and each of its ``variants(row)`` (name ->
    turns), the turns played when the input holds that variant's tag. Put them before any rule that
    matches a row's own text: a tagged message contains that text too."""
    return [
        {"contains": variant_tag(variant, i), "turns": turns}
        for i, row in enumerate(rows)
        for variant, turns in variants(row).items()
    ]
