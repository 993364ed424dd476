"""``ng_reverify``: score saved rollouts again with the current verifiers, old and new reward side by side.

Contract
--------
* Input: a rollouts file written by ``ng_collect_rollouts`` (``+input_jsonl_fpath``); servers running
  (``ng_run``), found through the head server as the collector finds them. Each line's
  ``agent_ref.name`` names its agent; the agent's ``resources_server`` is the verifier asked.
* What is posted to ``/verify`` is upstream NeMo Gym's re-verification payload: the task row the
  rollout came from plus its recorded ``response``. The row comes from the collector's
  ``<stem>_materialized_inputs.jsonl`` next to the input (or ``+inputs_jsonl_fpath``), matched by
  ``(_ng_task_index, _ng_rollout_index)``. ``+inputs_jsonl_fpath`` may also be the plain task file the
  rollouts were collected from (rows without those indices): row ``n`` (0-based, blank lines skipped)
  is task ``n``. For upstream's layout, ``<name>_rollouts.jsonl`` next to ``<name>.jsonl`` (e.g.
  ``data/example_rollouts.jsonl`` and ``data/example.jsonl``), that task file is found by itself.
  Without any of these, the line itself minus its ``reward`` is posted and a warning says so: task
  fields the verifier did not echo into its response (upstream's string_match drops
  ``extraction_mode``) then take their defaults, and the reward can differ.
* ``+where.<field>=<value>`` (repeatable, all must hold) re-verifies only lines whose top-level field
  equals the value; the other lines are copied unchanged. Default: every line.
* Output (``+output_jsonl_fpath``, never the input; an existing file only with ``+overwrite=true``):
  every line in input order; a re-verified line is the old line with the new verify response laid
  over it, plus ``previous_reward`` (its reward before). The file appears whole at the end (written
  to a temporary file, then renamed): an interruption or error leaves no partial output and never
  touches the input.
* Memory does not grow with the file: the input is read twice, line by line (once to check every line
  before anything is posted, once to verify and write as it goes), at most ``num_samples_in_parallel``
  verifications are in flight and a few times that many lines are held for writing in order; the
  task rows are found through an index of their byte offsets, read when needed.
* Before anything is posted, each resources server's ``GET /reverify_mode`` is asked: ``unsupported``
  (verify needs the rollout's live session state) refuses to run unless ``+force=true``; ``unknown``
  warns. A line whose ``/verify`` fails (unreachable, 5xx, judge down) is an infrastructure failure:
  it goes to ``<output stem>_failures.jsonl`` with the error and is left out of the output, never
  scored 0; the exit status is then 1.
* A summary: lines re-verified, rewards changed (up, down), mean reward before and after, and the
  first changed lines. Exit status: 0 done, 1 some lines failed, 2 bad input or options (nothing
  posted or written), 130 interrupted (nothing written).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.client.server_client import ServerClient, close_shared_session, find_instance_block
from nemo_gym.config.command import command
from nemo_gym.config.keys import HEAD_SERVER_KEY_NAME, ROLLOUT_INDEX_KEY_NAME, TASK_INDEX_KEY_NAME
from nemo_gym.config.loading import load_global_config
from nemo_gym.config.overrides import parse_cli_overrides
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.errors import UpstreamError, response_body

OPTIONS = (
    "input_jsonl_fpath",
    "output_jsonl_fpath",
    "inputs_jsonl_fpath",
    "where",
    "overwrite",
    "force",
    "num_samples_in_parallel",
    HEAD_SERVER_KEY_NAME,
)
USAGE = (
    "usage: ng_reverify +input_jsonl_fpath=<rollouts.jsonl> +output_jsonl_fpath=<new.jsonl>\n"
    "  [+inputs_jsonl_fpath=<materialized inputs, or the task file>] [+where.<field>=<value> ...] [+overwrite=true]\n"
    "  [+force=true] [+num_samples_in_parallel=64] [+head_server.host=127.0.0.1 +head_server.port=11000]\n"
    "exit status: 0 done, 1 some lines failed (see the failures file), 2 bad input or options, 130 interrupted"
)
SHOWN_CHANGES = 10


class ReverifyError(Exception):
    """Bad input or options: nothing was posted or written."""


def _key(row: dict[str, Any]) -> tuple[Any, Any] | None:
    task, rollout = row.get(TASK_INDEX_KEY_NAME), row.get(ROLLOUT_INDEX_KEY_NAME)
    return None if task is None or rollout is None else (task, rollout)


def iter_jsonl(path: Path, what: str, bad: list[str]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``(line number, byte offset, object)`` of each non-blank line, one at a time; a line that is not a
    JSON object is noted in ``bad`` (naming file and line) and skipped."""
    with open(path, "rb") as f:
        offset = 0
        for number, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                bad.append(f"{path}:{number}: not JSON ({e})")
                continue
            if not isinstance(value, dict):
                bad.append(f"{path}:{number}: not a JSON object")
                continue
            yield number, start, value


def _offset_for(keyed: dict[Any, int] | None, plain: Any, line: dict[str, Any]) -> int | None:
    """Where the task row of a rollouts line is: by its key in materialized inputs, else by task number."""
    if keyed is not None:
        return keyed.get(_key(line))
    task = line.get(TASK_INDEX_KEY_NAME)
    if isinstance(task, int) and not isinstance(task, bool) and 0 <= task < len(plain or ()):
        return int(plain[task])
    return None


class TaskRows:
    """The task rows of an inputs file, found by key without holding them: an index of byte offsets.

    The collector's materialized inputs are keyed by ``(_ng_task_index, _ng_rollout_index)``; a plain
    task file (rows without those indices) by row number (0-based, blank lines skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        bad: list[str] = []
        keyed: dict[tuple[Any, Any], int] = {}
        plain = array("q")
        for _, offset, row in iter_jsonl(path, "inputs file", bad):
            key = _key(row)
            if key is None:
                plain.append(offset)
            else:
                keyed.setdefault(key, offset)
        if bad:
            raise ReverifyError(f"{len(bad)} bad line(s) in the inputs file:\n  " + "\n  ".join(bad[:20]))
        if keyed and plain:
            raise ReverifyError(
                f"the inputs file mixes rows with and without {TASK_INDEX_KEY_NAME}/{ROLLOUT_INDEX_KEY_NAME}: "
                "give either the collector's materialized inputs or the plain task file"
            )
        self.keyed = keyed or None
        self.plain = None if keyed else plain
        self._file = open(path, "rb")  # noqa: SIM115  # closed by close()

    def __len__(self) -> int:
        return len(self.keyed) if self.keyed is not None else len(self.plain or ())

    def offset_for(self, line: dict[str, Any]) -> int | None:
        return _offset_for(self.keyed, self.plain, line)

    def read(self, offset: int) -> dict[str, Any]:
        self._file.seek(offset)
        return orjson.loads(self._file.readline())

    def close(self) -> None:
        self._file.close()


class _ListRows:
    """:class:`TaskRows`' interface over rows already in memory (for :func:`plan`)."""

    def __init__(self, inputs: list[dict[str, Any]]) -> None:
        keyed = [r for r in inputs if _key(r) is not None]
        if keyed and len(keyed) != len(inputs):
            raise ReverifyError(
                f"the inputs file mixes rows with and without {TASK_INDEX_KEY_NAME}/{ROLLOUT_INDEX_KEY_NAME}: "
                "give either the collector's materialized inputs or the plain task file"
            )
        self.rows = inputs
        self.keyed: dict[Any, int] | None = None
        if keyed:
            self.keyed = {}
            for i, r in enumerate(inputs):
                self.keyed.setdefault(_key(r), i)
        self.plain = None if keyed else list(range(len(inputs)))

    def __len__(self) -> int:
        return len(self.rows)

    def offset_for(self, line: dict[str, Any]) -> int | None:
        return _offset_for(self.keyed, self.plain, line)

    def read(self, offset: int) -> dict[str, Any]:
        return self.rows[offset]


def default_inputs_path(source: Path) -> Path | None:
    """The task rows of a rollouts file found next to it, or None.

    The collector's ``<stem>_materialized_inputs.jsonl`` first; else, for upstream NeMo Gym's layout,
    ``<name>.jsonl`` beside ``<name>_rollouts.jsonl``.
    """
    stem = source.with_suffix("") if source.suffix == ".jsonl" else source
    materialized = Path(f"{stem}_materialized_inputs.jsonl")
    if materialized.is_file():
        return materialized
    if stem.name.endswith("_rollouts"):
        task_file = stem.with_name(stem.name.removesuffix("_rollouts") + ".jsonl")
        if task_file.is_file():
            return task_file
    return None


def _matches(row: dict[str, Any], where: dict[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in where.items())


def payload_for(
    line: dict[str, Any], number: int, rows: TaskRows | _ListRows | None, source: Path, build: bool = True
) -> tuple[dict[str, Any] | None, str | None]:
    """``(/verify payload, None)`` for a line to re-verify, or ``(None, why not)`` naming the line.
    ``build=False`` only checks (the payload is then ``{}``: no task row is read)."""
    where_at = f"{source}: line {number}"
    if not isinstance(line.get("response"), dict):
        return None, f"{where_at}: no recorded 'response' to verify"
    agent_ref = line.get("agent_ref")
    if not isinstance(agent_ref, dict) or not isinstance(agent_ref.get("name"), str):
        return None, f"{where_at}: no 'agent_ref.name' (which agent's environment scored it?)"
    if rows is None:
        return ({k: v for k, v in line.items() if k != "reward"} if build else {}), None
    offset = rows.offset_for(line)
    if offset is None:
        if rows.keyed is None:
            return None, (f"{where_at}: its {TASK_INDEX_KEY_NAME} {line.get(TASK_INDEX_KEY_NAME)!r} is not a row "
                          f"of the task file ({len(rows)} rows)")  # fmt: skip
        return None, (f"{where_at}: no task row with its {TASK_INDEX_KEY_NAME}/{ROLLOUT_INDEX_KEY_NAME} "
                      f"{_key(line)} in the inputs file")  # fmt: skip
    return ({**rows.read(offset), "response": line["response"]} if build else {}), None


def plan(
    lines: list[dict[str, Any]],
    inputs: list[dict[str, Any]] | None,
    where: dict[str, Any],
    source: Path,
) -> list[tuple[int, dict[str, Any]]]:
    """``(line index, /verify payload)`` for each line to re-verify; errors name the line and field.
    (The in-memory form of what :func:`main` does line by line.)"""
    rows = _ListRows(inputs) if inputs else None
    todo: list[tuple[int, dict[str, Any]]] = []
    problems: list[str] = []
    for i, line in enumerate(lines):
        if not _matches(line, where):
            continue
        payload, problem = payload_for(line, i + 1, rows, source)
        if problem is not None:
            problems.append(problem)
        else:
            todo.append((i, payload))  # type: ignore[arg-type]
    if problems:
        raise ReverifyError(
            f"{len(problems)} line(s) cannot be re-verified:\n  " + "\n  ".join(problems[:20])
        )
    return todo


def check_input(source: Path, rows: TaskRows | None, where: dict[str, Any]) -> set[str]:
    """The first pass: every line of ``source`` is a JSON object and every line to re-verify has what it
    needs (raises :class:`ReverifyError` listing the problems). Returns the agents named."""
    bad: list[str] = []
    problems: list[str] = []
    agents: set[str] = set()
    for number, _, line in iter_jsonl(source, "rollouts file", bad):
        if not _matches(line, where):
            continue
        _, problem = payload_for(line, number, rows, source, build=False)
        if problem is not None:
            problems.append(problem)
        else:
            agents.add(line["agent_ref"]["name"])
    if bad:
        raise ReverifyError(f"{len(bad)} bad line(s) in the rollouts file:\n  " + "\n  ".join(bad[:20]))
    if problems:
        raise ReverifyError(
            f"{len(problems)} line(s) cannot be re-verified:\n  " + "\n  ".join(problems[:20])
        )
    return agents


def _resources_server_of(config: Any, agent: str) -> str:
    found = find_instance_block(config, agent)
    if found is None or found[0] != "responses_api_agents":
        raise ReverifyError(f"agent '{agent}' (agent_ref.name) is not an agent of the running servers")
    ref = found[2].get("resources_server") if hasattr(found[2], "get") else None
    name = ref.get("name") if hasattr(ref, "get") else None
    if not name:
        raise ReverifyError(f"agent '{agent}' has no resources_server to verify with")
    return str(name)


class _Summary:
    """Running totals for the summary (nothing per line is kept but the first changes)."""

    def __init__(self) -> None:
        self.reverified = self.failed = self.changed = self.up = self.down = 0
        self.before: list[float] = [0.0, 0]  # sum, count
        self.after: list[float] = [0.0, 0]
        self.first_changes: list[tuple[int, Any, Any]] = []

    def add(self, number: int, before: Any, after: Any) -> None:
        self.reverified += 1
        for value, acc in ((before, self.before), (after, self.after)):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                acc[0] += float(value)
                acc[1] += 1
        if before != after:
            self.changed += 1
            if isinstance(before, (int, float)) and isinstance(after, (int, float)):
                self.up += after > before
                self.down += after < before
            if len(self.first_changes) < SHOWN_CHANGES:
                self.first_changes.append((number, before, after))

    def result(self) -> dict[str, Any]:
        return {
            "interrupted": False,
            "reverified": self.reverified,
            "failed": self.failed,
            "changed": self.changed,
            "up": self.up,
            "down": self.down,
            "mean_before": self.before[0] / max(1, self.before[1]),
            "mean_after": self.after[0] / max(1, self.after[1]),
            "first_changes": self.first_changes,
        }


async def check_reverify_modes(client: ServerClient, agents: set[str], force: bool) -> dict[str, str]:
    """``{agent: its resources server}``, after asking each server whether its verify may be re-run."""
    servers = {agent: _resources_server_of(client.global_config_dict, agent) for agent in sorted(agents)}
    for name in sorted(set(servers.values())):
        resp = await client.get(name, "/reverify_mode")
        mode = orjson.loads(response_body(resp)) if resp.status == 200 else "unknown"
        if mode == "unsupported" and not force:
            raise ReverifyError(
                f"resources server '{name}' says its /verify needs the rollout's live session state "
                "(reverify_mode: unsupported), so re-verifying stored rollouts would score them wrongly; "
                "+force=true runs it anyway"
            )
        if mode != "stateless":
            sys.stderr.write(f"ng_reverify: resources server '{name}' reverify_mode is {mode!r}\n")
    return servers


async def reverify(
    source: Path,
    rows: TaskRows | None,
    where: dict[str, Any],
    servers: dict[str, str],
    client: ServerClient,
    output: Path,
    failures_path: Path,
    parallel: int = 64,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Read ``source`` line by line, post each line to re-verify to its verifier (at most ``parallel`` at
    once), and write the output in input order as results arrive: atomically at the end, failures to
    ``failures_path``. Returns the summary (``{"interrupted": True}`` when ``stop`` was set)."""
    parallel = max(1, parallel)
    slots = asyncio.Semaphore(parallel)
    window: collections.deque[tuple[int, dict[str, Any], asyncio.Task | None]] = collections.deque()
    summary = _Summary()
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    failures_fd, failures_tmp = tempfile.mkstemp(prefix=f".{failures_path.name}.", dir=failures_path.parent)

    async def one(payload: dict[str, Any], server: str) -> dict[str, Any]:
        async with slots:
            resp = await client.post(server, "/verify", json=payload)
        body = response_body(resp)
        if resp.status >= 400:
            raise UpstreamError(server, "/verify", resp.status, body[:2000])
        return orjson.loads(body)

    try:
        with os.fdopen(fd, "wb") as out, os.fdopen(failures_fd, "wb") as failures:

            async def write_head() -> None:
                number, line, task = window.popleft()
                if task is None:
                    out.write(orjson.dumps(line) + b"\n")
                    return
                try:
                    result = await task
                except Exception as error:  # an infrastructure failure: never a reward
                    summary.failed += 1
                    record = {"line": number, **{k: line.get(k) for k in (TASK_INDEX_KEY_NAME,
                              ROLLOUT_INDEX_KEY_NAME, "agent_ref")}, "error": f"{type(error).__name__}: {error}"}  # fmt: skip
                    failures.write(orjson.dumps(record) + b"\n")
                    return
                new = {**line, **result, "previous_reward": line.get("reward")}
                summary.add(number, line.get("reward"), new.get("reward"))
                out.write(orjson.dumps(new) + b"\n")

            bad: list[str] = []
            for number, _, line in iter_jsonl(source, "rollouts file", bad):
                if stop is not None and stop.is_set():
                    break
                task = None
                if _matches(line, where):
                    payload, problem = payload_for(line, number, rows, source)
                    if problem is not None:  # the file changed since it was checked
                        raise ReverifyError(problem)
                    server = servers[line["agent_ref"]["name"]]
                    task = asyncio.ensure_future(one(payload, server))  # type: ignore[arg-type]
                window.append((number, line, task))
                while window and (len(window) >= 4 * parallel or window[0][2] is None or window[0][2].done()):
                    await write_head()
            if bad:
                raise ReverifyError(f"the rollouts file changed while it was read: {bad[0]}")
            while window and not (stop is not None and stop.is_set()):
                await write_head()
        if stop is not None and stop.is_set():
            raise _Interrupted
        os.replace(tmp, output)
        if summary.failed:
            os.replace(failures_tmp, failures_path)
    except _Interrupted:
        return {"interrupted": True}
    finally:
        for _, _, task in window:
            if task is not None:
                task.cancel()
        for path in (tmp, failures_tmp):
            with contextlib.suppress(OSError):
                os.unlink(path)
    return summary.result()


class _Interrupted(Exception):
    pass


def format_summary(s: dict[str, Any], output: Path) -> str:
    text = (
        f"re-verified {s['reverified']} line(s): {s['changed']} reward(s) changed ({s['up']} up, {s['down']} down); "
        f"mean reward {s['mean_before']:.4f} -> {s['mean_after']:.4f}; failed {s['failed']}. Wrote {output}"
    )
    for line, b, a in s["first_changes"]:
        text += f"\n  line {line}: {b} -> {a}"
    return text


@command("ng_reverify")
def main(argv: list[str] | None = None) -> None:
    """``ng_reverify`` (see the module docstring)."""
    from omegaconf import OmegaConf

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    try:
        unknown = sorted(
            {o.key.split(".")[0] for o in parse_cli_overrides(argv) if not o.delete} - set(OPTIONS)
        )
        if unknown:
            raise ReverifyError(f"unknown option(s): {', '.join('+' + k for k in unknown)}. See --help.")
        cfg = OmegaConf.to_container(load_global_config(argv).config, resolve=True)
        source = Path(str(cfg.get("input_jsonl_fpath") or ""))
        output = Path(str(cfg.get("output_jsonl_fpath") or ""))
        if not cfg.get("input_jsonl_fpath") or not cfg.get("output_jsonl_fpath"):
            raise ReverifyError(
                "pass +input_jsonl_fpath=<rollouts.jsonl> and +output_jsonl_fpath=<new.jsonl>"
            )
        if not source.is_file():
            raise ReverifyError(f"{source} is not a file (+input_jsonl_fpath)")
        if output.resolve() == source.resolve():
            raise ReverifyError(
                "+output_jsonl_fpath must differ from +input_jsonl_fpath (the input is never rewritten)"
            )
        if output.exists() and not cfg.get("overwrite"):
            raise ReverifyError(f"{output} exists; pass +overwrite=true to replace it")
        where = cfg.get("where") or {}
        if not isinstance(where, dict):
            raise ReverifyError("+where takes fields: +where.<field>=<value>")
        stem = source.with_suffix("") if source.suffix == ".jsonl" else source
        inputs_path = Path(str(cfg["inputs_jsonl_fpath"])) if cfg.get("inputs_jsonl_fpath") else None
        if inputs_path is not None and not inputs_path.is_file():
            raise ReverifyError(f"{inputs_path} is not a file (+inputs_jsonl_fpath)")
        inputs_path = inputs_path or default_inputs_path(source)
        if inputs_path is None:
            sys.stderr.write(
                f"ng_reverify: warning: no task rows for {source} (no {stem.name}_materialized_inputs.jsonl "
                "next to it, no +inputs_jsonl_fpath): each line is verified as recorded, so task fields the "
                "verifier did not echo back take their defaults. Pass +inputs_jsonl_fpath=<the task JSONL> "
                "for the exact rows.\n"
            )
        else:
            sys.stderr.write(f"ng_reverify: task rows from {inputs_path}\n")
        rows = TaskRows(inputs_path) if inputs_path else None
        agents = check_input(source, rows, where)
        head = cfg.get(HEAD_SERVER_KEY_NAME) or {}
        head_cfg = BaseServerConfig(host=head.get("host") or "127.0.0.1", port=int(head.get("port") or 11000))
        parallel = int(cfg.get("num_samples_in_parallel") or 64)
    except (ConfigError, ReverifyError, ValueError) as e:
        sys.stderr.write(f"ng_reverify: {e}\n")
        sys.exit(2)
    out_stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    failures_path = Path(f"{out_stem}_failures.jsonl")

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        client = ServerClient.load_from_global_config(head_cfg)
        try:
            servers = await check_reverify_modes(client, agents, bool(cfg.get("force")))
            return await reverify(source, rows, where, servers, client, output, failures_path, parallel, stop)
        finally:
            await close_shared_session()
            if rows is not None:
                rows.close()

    try:
        summary = asyncio.run(run())
    except (ReverifyError, ConnectionError) as e:
        sys.stderr.write(f"ng_reverify: {e}\n")
        sys.exit(2)
    if summary["interrupted"]:
        sys.stderr.write("ng_reverify: interrupted; nothing written\n")
        sys.exit(130)
    print(format_summary(summary, output), flush=True)
    if summary["failed"]:
        sys.stderr.write(f"ng_reverify: {summary['failed']} line(s) failed, left out; see {failures_path}\n")
        sys.exit(1)
