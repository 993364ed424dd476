"""``ng_quickstart``: the whole job end to end on one machine, with no key, no GPU and no downloads.

Contract
--------
* Starts the servers of ``configs/quickstart.yaml`` (``local_model`` with the packaged 1.5B
  weights, a real LLM on the CPU, plus the ``example_single_tool_call`` environment and its agent) through :class:`RunHelper`, with
  the head server on a free port, so it never collides with a running ``ng_run``.
* Collects the 5 example rollouts with :func:`collect_rollouts` into
  ``results/quickstart_rollouts.jsonl`` (relative to the working directory; replaced on each run),
  prints each trajectory in one or two lines (question, tool call, answer, reward) and the summary,
  ending with ``Average reward: X``.
* Always stops the servers: on success, on failure, and on Ctrl+C / SIGTERM (exit status 130 then;
  1 when start-up fails or no rollout completes; 0 otherwise).
* Extra Hydra-style arguments are merged into the config, e.g.
  ``ng_quickstart ++policy_model.responses_api_models.local_model.model_path=/path/model.gguf``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.collection.collector import collect_rollouts, format_summary
from nemo_gym.collection.options import InputError, RolloutCollectionConfig
from nemo_gym.collection.summary import CollectionSummary
from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.parser import GlobalConfigDictParserConfig
from nemo_gym.config.problems import ConfigError
from nemo_gym.run.cli import RunHelper
from nemo_gym.run.supervision.children import StartupError

QUICKSTART_CONFIG = "configs/quickstart.yaml"
AGENT_NAME = "example_single_tool_call_simple_agent"
INPUT_JSONL = PACKAGE_PARENT_DIR / "resources_servers" / "example_single_tool_call" / "data" / "example.jsonl"
OUTPUT_JSONL = Path("results") / "quickstart_rollouts.jsonl"
REQUEST_TIMEOUT_S = 900.0

USAGE = """\
usage: ng_quickstart [++key=value ...]

Starts a real 1.5B LLM on the CPU (local_model) with the example_single_tool_call environment,
collects the 5 example rollouts into results/quickstart_rollouts.jsonl, prints the average reward,
and stops the servers. Extra arguments are config overrides, e.g.
  ++policy_model.responses_api_models.local_model.model_path=/path/to/model.gguf
"""


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_rollout(row: dict[str, Any]) -> str:
    """The trajectory of one rollout in a few lines: the question, each tool call and result, the answer."""
    params = row.get("responses_create_params") or {}
    items = params.get("input") or []
    question = (
        items
        if isinstance(items, str)
        else next(
            (i.get("content") for i in reversed(items) if isinstance(i, dict) and i.get("role") == "user"), ""
        )
    )
    lines = [f"Q: {_short(question if isinstance(question, str) else orjson.dumps(question).decode())}"]
    for item in (row.get("response") or {}).get("output") or []:
        kind = item.get("type")
        if kind == "function_call":
            lines.append(f"   tool call : {item.get('name')}({_short(item.get('arguments', ''), 100)})")
        elif kind == "function_call_output":
            output = item.get("output")
            lines.append(
                f"   tool says : {_short(output if isinstance(output, str) else orjson.dumps(output).decode(), 100)}"
            )
        elif kind == "message":
            content = item.get("content")
            text = (
                content
                if isinstance(content, str)
                else "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
            )
            lines.append(f"   answer    : {_short(text)}")
    lines.append(f"   reward    : {row.get('reward')}")
    return "\n".join(lines)


async def _collect(helper: RunHelper, output: Path) -> CollectionSummary:
    cfg = RolloutCollectionConfig(
        input_jsonl_fpath=str(INPUT_JSONL),
        output_jsonl_fpath=str(output),
        agent_name=AGENT_NAME,
        overwrite=True,
        request_timeout_s=REQUEST_TIMEOUT_S,
        progress=sys.stderr.isatty(),
    )
    client = await asyncio.to_thread(
        ServerClient.load_from_global_config, helper.head_server_config, timeout_s=REQUEST_TIMEOUT_S
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        return await collect_rollouts(cfg, client, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        await close_shared_session()


def run_quickstart(argv: list[str], output: Path = OUTPUT_JSONL) -> int:
    """The whole quickstart; returns the exit status."""
    t0 = time.monotonic()
    initial = {"config_paths": [QUICKSTART_CONFIG], "head_server": {"host": "127.0.0.1", "port": 0}}
    helper = RunHelper()
    # SIGTERM during start-up takes the same path as Ctrl+C (the servers are stopped in `finally`).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        print(
            "ng_quickstart: starting local_model (a 1.5B LLM on the CPU) and example_single_tool_call ...",
            flush=True,
        )
        try:
            helper.start(
                GlobalConfigDictParserConfig(
                    initial_global_config_dict=initial,
                    cli_args=list(argv),
                    skip_load_from_cli=not argv,
                    skip_load_from_env_yaml=True,
                )
            )
        except (ConfigError, StartupError) as e:
            sys.stderr.write(f"ng_quickstart: start-up failed.\n{e}\n")
            return 1
        print(
            f"ng_quickstart: servers ready in {time.monotonic() - t0:.1f} s; collecting 5 rollouts ...",
            flush=True,
        )
        try:
            summary = asyncio.run(_collect(helper, output))
        except (InputError, ConnectionError) as e:
            sys.stderr.write(f"ng_quickstart: {e}\n")
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.default_int_handler)  # asyncio leaves SIG_DFL behind
        print()
        with open(output, "rb") as f:
            rows = sorted(
                (orjson.loads(line) for line in f if line.strip()), key=lambda r: r["_ng_task_index"]
            )
        for row in rows:
            print(f"[{row['_ng_task_index'] + 1}] " + describe_rollout(row))
        print()
        print(format_summary(summary))
        print(f"ng_quickstart: done in {time.monotonic() - t0:.1f} s (rollouts in {output})", flush=True)
        if summary.interrupted:
            return 130
        return 0 if summary.rollouts_ok else 1
    except KeyboardInterrupt:
        sys.stderr.write("\nng_quickstart: interrupted; stopping the servers.\n")
        return 130
    finally:
        helper.shutdown()
        signal.signal(signal.SIGTERM, previous)


@command("ng_quickstart")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return
    sys.exit(run_quickstart(argv))


if __name__ == "__main__":
    main()
