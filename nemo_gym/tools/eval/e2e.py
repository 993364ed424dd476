"""``ng_e2e_collect_rollouts``: one command from config files to reward-annotated rollouts and metrics.

Contract
--------
``ng_e2e_collect_rollouts "+config_paths=[...]" +split=validation +output_jsonl_fpath=results/eval.jsonl``
* Reads the config as ``ng_run`` does (YAML files, env.yaml, overrides). The datasets are those of
  type ``+split`` (``train``, ``validation``, ``example`` or ``benchmark``) that the agents declare
  (``datasets: [{name, type, jsonl_fpath, num_repeats?}]``), found and validated with
  :mod:`nemo_gym.tools.data.prepare`'s functions; ``+agent_name=<agent>`` keeps one agent only.
* Everything is checked before any server starts or any file is written: an unknown ``+split`` or
  option, an unknown agent, a split no agent declares (the message lists what each agent declares), a
  missing dataset file, a row that is not a valid agent request (``file:line: field``), an output that
  already has rollouts without ``+resume_from_cache=true`` / ``+overwrite=true``. Exit status 2.
* Files, with ``<stem>`` the output path without ``.jsonl``:
  ``<stem>/preprocessed_datasets/<split>.jsonl`` (every row once, with ``agent_ref``) and
  ``<split>_metrics.json``; per agent ``<stem>/preprocessed_datasets/<split>/<agent>.jsonl`` (its rows)
  and ``<stem>/rollouts/<agent>.jsonl`` with the collector's sidecars (materialized inputs, failures,
  aggregate metrics). At the end ``<output>`` holds every agent's rollouts (agent after agent; task
  indices count per agent, ``agent_ref`` tells them apart) and ``<stem>_aggregate_metrics.json`` the
  per-agent and overall metrics.
* Collection is ``ng_collect_rollouts``' code, agent after agent, with its options (``limit``,
  ``num_samples_in_parallel``, ``responses_create_params``, ``num_repeats_add_seed``, ``max_attempts``,
  ...). Repeats per agent: ``+agent_num_repeats.<agent>=K``, else ``+num_repeats=K``, else the
  ``num_repeats`` its datasets declare (they must agree), else 1.
* Servers start as with ``ng_run`` and stop at the end, also on error. SIGINT/SIGTERM: nothing new
  starts, in-flight rollouts are cancelled, every whole line written is kept; the combined output and
  metrics are written for what is done; exit 130. ``+resume_from_cache=true`` then runs exactly what
  is missing. Exit status: 0 all done, 1 rollouts missing after failures (or a server failed to
  start), 2 bad input, 3 stopped early because a server is down, 130 interrupted.
* While it collects: the progress bar shows the live numbers of :mod:`nemo_gym.collection.live_stats`;
  ``+metrics_port=PORT`` serves them for the whole run on ``GET http://127.0.0.1:PORT/metrics``; at
  the end they are the ``live`` block of ``overall`` (each agent's in its ``per_agent`` entry).
* ``+tracker=mlflow|wandb`` exports the metrics to an experiment tracker (:mod:`nemo_gym.collection.tracking`).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
from omegaconf import DictConfig, OmegaConf
from pydantic import Field, ValidationError

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.collection.cli import EXIT_SERVER_DOWN
from nemo_gym.collection.collector import collect_rollouts, format_summary
from nemo_gym.collection.live_stats import LiveMetricsServer, LiveStats
from nemo_gym.collection.options import CollectionOptions, InputError, RolloutCollectionConfig
from nemo_gym.collection.output_files import sidecar_paths
from nemo_gym.collection.summary import CollectionSummary
from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.loading import LoadedConfig, load_global_config
from nemo_gym.config.options import option_problems
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.config.validation import validate_global_config
from nemo_gym.redaction import add_secret_values, config_secret_values, scrub
from nemo_gym.run.supervision.stop import StopFlag
from nemo_gym.server.startup import tune_gc_for_throughput
from nemo_gym.tools.data.metrics import DatasetMetrics
from nemo_gym.tools.data.prepare import (
    AGENT_SERVER_TYPE,
    Dataset,
    atomic_writer,
    declared_datasets,
    iter_valid_rows,
    json_file_bytes,
    locate,
    read_rows,
    write_atomic,
)

COMMAND = "ng_e2e_collect_rollouts"
SPLITS = ("train", "validation", "example", "benchmark")
USAGE = f"""\
usage: {COMMAND} "+config_paths=[env.yaml files..., model.yaml]" +split=train|validation|example|benchmark
         +output_jsonl_fpath=results/eval.jsonl [+agent_name=<agent>] [+num_repeats=K]
         [+agent_num_repeats.<agent>=K ...] [+limit=N] [+num_samples_in_parallel=P]
         [+responses_create_params.temperature=0.7 ...] [+num_repeats_add_seed=true] [+resume_from_cache=true]
         [+overwrite=true] [+max_attempts=3] [+pass_threshold=1.0] [+request_timeout_s=3600] [+progress=false]
         [+tracker=mlflow|wandb] [+observability_enabled=true] [+metrics_port=PORT (0: a free one)]
         [+head_server.port=11000] [any ng_run option]
Starts the servers, collects rollouts on the datasets of type +split that the agents declare, writes
per-agent and overall metrics, stops the servers.
exit status: 0 all done, 1 rollouts missing (see the failures files), 2 bad input, 3 a server is down,
  130 interrupted (rerun with +resume_from_cache=true)"""


class E2ECollectionConfig(CollectionOptions):
    """The options of ``ng_e2e_collect_rollouts`` (besides ``ng_run``'s and the server configs)."""

    split: Literal["train", "validation", "example", "benchmark"]
    num_repeats: int | None = Field(default=None, ge=1)
    agent_num_repeats: dict[str, int] = Field(default_factory=dict)


# The top-level keys this command reads (registered in nemo_gym.config.process.COMMAND_OPTIONS).
E2E_OPTIONS = tuple(E2ECollectionConfig.model_fields)


@dataclass
class AgentPlan:
    """One agent's share of the run: its datasets, repeats, input and output files."""

    agent: str
    datasets: list[Dataset]
    num_repeats: int
    input_path: Path
    output_path: Path

    @property
    def n_rows(self) -> int:
        return sum(d.n_rows for d in self.datasets)

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        """Its datasets' rows with ``agent_ref``, read again from the (validated) files one at a time."""
        ref = {"type": AGENT_SERVER_TYPE, "name": self.agent}
        for d in self.datasets:
            for row in iter_valid_rows(d):
                yield {**row, "agent_ref": ref}


def _stem(output: Path) -> Path:
    return output.with_suffix("") if output.suffix == ".jsonl" else output


def parse_options(loaded: LoadedConfig) -> E2ECollectionConfig:
    """The command's options from the merged config; a ConfigError names each bad one."""
    cfg = loaded.config
    values: dict[str, Any] = {}
    for key in E2E_OPTIONS:
        node = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if node is not None:
            values[key] = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    if "split" not in values:
        raise ConfigError(f"{COMMAND}: +split is required: one of {', '.join(SPLITS)}.")
    if "output_jsonl_fpath" not in values:
        raise ConfigError(f"{COMMAND}: +output_jsonl_fpath=<rollouts.jsonl> is required.")
    try:
        return E2ECollectionConfig.model_validate(values)
    except ValidationError as e:
        msgs = [f"+{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"{COMMAND}: invalid options:\n  " + "\n  ".join(msgs)) from None


def agent_instances(loaded: LoadedConfig) -> list[str]:
    """The agent instance names of the config, in config order."""
    cfg = loaded.config
    names = []
    for name in map(str, cfg.keys()):
        node = cfg._get_node(name)
        if isinstance(node, DictConfig) and AGENT_SERVER_TYPE in node:
            names.append(name)
    return names


def _unknown_agent(name: str, agents: list[str], what: str) -> ConfigError:
    close = difflib.get_close_matches(name, agents, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(
        f"{COMMAND}: {what} '{name}' is not an agent of the config.{hint} "
        f"Agents: {', '.join(agents) or 'none (add an environment config to +config_paths)'}."
    )


def make_plan(loaded: LoadedConfig, opts: E2ECollectionConfig) -> list[AgentPlan]:
    """Find, validate and group the datasets of the split per agent; raises ConfigError, writes nothing."""
    agents = agent_instances(loaded)
    if opts.agent_name is not None and opts.agent_name not in agents:
        raise _unknown_agent(opts.agent_name, agents, "+agent_name")
    for name in opts.agent_num_repeats:
        if name not in agents:
            raise _unknown_agent(name, agents, "+agent_num_repeats key")
    every = list(declared_datasets(loaded))
    chosen = [
        d for d in every if d.type == opts.split and (opts.agent_name is None or d.agent == opts.agent_name)
    ]
    if not chosen:
        declared: dict[str, list[str]] = {a: [] for a in agents}
        for d in every:
            declared.setdefault(d.agent, []).append(f"{d.entry['name']} ({d.type})")
        scope = f"agent '{opts.agent_name}'" if opts.agent_name else "no agent of the config"
        lines = [f"  - {a}: {', '.join(ds) or 'no datasets'}" for a, ds in declared.items()]
        raise ConfigError(
            f"{COMMAND}: {scope} declares a dataset of type '{opts.split}' (+split). Declared datasets:\n"
            + ("\n".join(lines) or "  (no agents: add an environment config to +config_paths)")
        )
    missing = []
    for d in chosen:
        d.path = locate(d, loaded.root_dir)
        if d.path is None:
            missing.append(
                f"  - {d.label()}: jsonl_fpath {d.entry['jsonl_fpath']!r} does not exist "
                f"(looked in {loaded.root_dir} and {PACKAGE_PARENT_DIR})"
            )
    if missing:
        raise ConfigError(f"{COMMAND}: dataset files are missing:\n" + "\n".join(missing))
    problems = [p for d in chosen for p in read_rows(d, keep_rows=False)]  # rows are read again later
    if problems:
        raise ConfigError(
            f"{COMMAND}: rows that are not valid agent requests (nothing was started or written):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    stem = _stem(Path(opts.output_jsonl_fpath))
    plans = []
    for agent in dict.fromkeys(d.agent for d in chosen):
        mine = [d for d in chosen if d.agent == agent]
        repeats = opts.agent_num_repeats.get(agent) or opts.num_repeats
        if repeats is None:
            declared_repeats = {d.num_repeats for d in mine}
            if len(declared_repeats) > 1:
                raise ConfigError(
                    f"{COMMAND}: the {opts.split} datasets of agent '{agent}' declare different num_repeats ("
                    + ", ".join(f"{d.label()}: {d.num_repeats}" for d in mine)
                    + f"); set +agent_num_repeats.{agent}=K"
                )
            repeats = declared_repeats.pop()
        if repeats < 1:
            raise ConfigError(f"{COMMAND}: +agent_num_repeats.{agent} must be >= 1, got {repeats}")
        plans.append(
            AgentPlan(
                agent=agent,
                datasets=mine,
                num_repeats=repeats,
                input_path=stem / "preprocessed_datasets" / opts.split / f"{agent}.jsonl",
                output_path=stem / "rollouts" / f"{agent}.jsonl",
            )
        )
    return plans


def check_outputs(opts: E2ECollectionConfig, plans: list[AgentPlan]) -> None:
    """Refuse to start over rollouts already written unless resuming or overwriting (nothing touched)."""
    if opts.resume_from_cache or opts.overwrite:
        return
    output = Path(opts.output_jsonl_fpath)
    written = [p for p in [output, *(a.output_path for a in plans)] if p.is_file() and p.stat().st_size]
    if written:
        raise ConfigError(
            f"{COMMAND}: rollouts already exist ({', '.join(map(str, written))}). Pass +resume_from_cache=true "
            "to complete them, +overwrite=true to start over, or choose another +output_jsonl_fpath."
        )
    sources = {d.path.resolve() for a in plans for d in a.datasets if d.path is not None}
    if output.resolve() in sources:
        raise ConfigError(f"{COMMAND}: +output_jsonl_fpath {output} is a dataset file; choose another path.")


def write_inputs(opts: E2ECollectionConfig, plans: list[AgentPlan]) -> Path:
    """The collated split file (every row once, with agent_ref), its metrics, and each agent's rows.

    Streamed (a row at a time into both files, each renamed into place when whole): memory does not
    grow with the datasets."""
    prepared = _stem(Path(opts.output_jsonl_fpath)) / "preprocessed_datasets"
    total = DatasetMetrics()
    collated = prepared / f"{opts.split}.jsonl"
    with atomic_writer(collated) as every:
        for plan in plans:
            with atomic_writer(plan.input_path) as mine:
                for row in plan.iter_rows():
                    line = orjson.dumps(row) + b"\n"
                    mine.write(line)
                    every.write(line)
            for d in plan.datasets:
                total.merge(d.metrics)
    write_atomic(prepared / f"{opts.split}_metrics.json", json_file_bytes(total.to_json()))
    return collated


def collection_config(opts: E2ECollectionConfig, plan: AgentPlan) -> RolloutCollectionConfig:
    """``ng_collect_rollouts``' options for one agent's share."""
    resume = opts.resume_from_cache and plan.output_path.exists()
    return RolloutCollectionConfig(
        input_jsonl_fpath=str(plan.input_path),
        output_jsonl_fpath=str(plan.output_path),
        agent_name=plan.agent,
        limit=opts.limit,
        num_repeats=plan.num_repeats,
        num_samples_in_parallel=opts.num_samples_in_parallel,
        responses_create_params=opts.responses_create_params,
        num_repeats_add_seed=opts.num_repeats_add_seed,
        resume_from_cache=resume,
        overwrite=opts.overwrite or not resume,
        max_attempts=opts.max_attempts,
        circuit_breaker_threshold=opts.circuit_breaker_threshold,
        pass_threshold=opts.pass_threshold,
        request_timeout_s=opts.request_timeout_s,
        progress=opts.progress,
        observability_enabled=opts.observability_enabled,
    )


async def collect_all(
    opts: E2ECollectionConfig,
    plans: list[AgentPlan],
    head: BaseServerConfig,
    stop: asyncio.Event,
    live: LiveStats | None = None,
) -> dict[str, CollectionSummary]:
    """Collect agent after agent; returns each started agent's collector summary.

    ``live`` receives every agent's counts; with ``+metrics_port`` it is served on ``GET /metrics``
    from the first agent's collection to the end of the last (one port for the whole run).
    """
    client = ServerClient.load_from_global_config(head, timeout_s=opts.request_timeout_s)
    summaries: dict[str, CollectionSummary] = {}
    live = live if live is not None else LiveStats()
    server = None
    try:
        if opts.metrics_port is not None:
            server = LiveMetricsServer(live, opts.metrics_port)
            print(f"Live collection stats: {server.url}", flush=True)
        for plan in plans:
            if stop.is_set():
                break
            cfg = collection_config(opts, plan)
            print(
                f"\n== {plan.agent}: {plan.input_path} x {plan.num_repeats} -> {plan.output_path}", flush=True
            )
            summaries[plan.agent] = await collect_rollouts(cfg, client, stop, live=live)
            print(format_summary(summaries[plan.agent]), flush=True)
    finally:
        live.finish()
        if server is not None:
            server.close()
        await close_shared_session()
    return summaries


def overall_metrics(
    opts: E2ECollectionConfig,
    plans: list[AgentPlan],
    summaries: dict[str, CollectionSummary],
    interrupted: bool,
    live: LiveStats | None = None,
) -> dict[str, Any]:
    """Per-agent metrics (without per-task detail) and the overall ones (with ``live``: its block,
    the whole run's live numbers; each agent's are in its entry)."""
    per_agent: dict[str, Any] = {}
    for plan in plans:
        s = summaries.get(plan.agent)
        if s is None:
            per_agent[plan.agent] = {"started": False, "num_repeats": plan.num_repeats}
            continue
        entry: dict[str, Any] = {
            "num_repeats": s.num_repeats,
            "rows": s.rows,
            "expected_rollouts": s.expected_rollouts,
            "rollouts_ok": s.rollouts_ok,
            "rollouts_missing": s.rollouts_missing,
        }
        if "num_tasks" in s.metrics:
            entry["num_tasks"] = s.metrics["num_tasks"]
        entry.update({k: v for k, v in s.metrics.items() if k.startswith(("mean/", "std/", "pass@"))})
        entry.update(
            tokens=s.metrics["tokens"], failed_this_run=s.this_run.failed, files=s.files, started=True
        )
        if s.live is not None:
            entry["live"] = s.live
        per_agent[plan.agent] = entry
    done = [e for e in per_agent.values() if e.get("started")]
    n_ok = sum(e["rollouts_ok"] for e in done)
    with_reward = [e for e in done if "mean/reward" in e and e["rollouts_ok"]]
    overall: dict[str, Any] = {
        "split": opts.split,
        "agents": len(plans),
        "expected_rollouts": sum(s.expected_rollouts for s in summaries.values()),
        "rollouts_ok": n_ok,
        "rollouts_missing": sum(e["rollouts_missing"] for e in done),
        "agents_not_started": [a for a, e in per_agent.items() if not e.get("started")],
        "interrupted": interrupted,
        "tokens": {
            k: sum(e["tokens"].get(k, 0) for e in done)
            for k in ("input_tokens", "output_tokens", "total_tokens")
        },
    }
    if with_reward:
        # Over all rollouts (an agent with more rollouts weighs more) and over agents (each agent once).
        overall["mean/reward"] = sum(e["mean/reward"] * e["rollouts_ok"] for e in with_reward) / sum(
            e["rollouts_ok"] for e in with_reward
        )
        overall["mean_over_agents/reward"] = sum(e["mean/reward"] for e in with_reward) / len(with_reward)
    if live is not None:
        overall["live"] = live.to_dict()
    return {"overall": overall, "per_agent": per_agent, "output_jsonl_fpath": opts.output_jsonl_fpath}


def write_combined(output: Path, plans: list[AgentPlan]) -> int:
    """Every agent's rollouts, agent after agent, into ``output``: streamed into a temporary file that
    is then renamed, so a reader never sees half of it; a line cut short by a hard kill is left out."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    lines = 0
    try:
        with open(tmp, "wb") as out:
            for plan in plans:
                if not plan.output_path.is_file():
                    continue
                with open(plan.output_path, "rb") as f:
                    for line in f:
                        if line.endswith(b"\n"):
                            out.write(line)
                            lines += 1
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return lines


def format_overall(metrics: dict[str, Any]) -> str:
    o = metrics["overall"]
    out = [f"\n== {COMMAND} ({o['split']}): {o['rollouts_ok']} / {o['expected_rollouts']} rollouts ok"]
    for agent, e in metrics["per_agent"].items():
        if not e.get("started"):
            out.append(f"  {agent:<40} not started")
            continue
        reward = f"mean reward {e['mean/reward']:.4f}" if "mean/reward" in e else "no rewards"
        out.append(f"  {agent:<40} {e['rollouts_ok']:>6} / {e['expected_rollouts']:<6} {reward}")
    if "mean/reward" in o:
        out.append(
            f"Overall mean reward {o['mean/reward']:.4f} (over agents {o['mean_over_agents/reward']:.4f})"
        )
    return "\n".join(out)


def run(
    loaded: LoadedConfig, opts: E2ECollectionConfig, plans: list[AgentPlan], stop_thread: StopFlag
) -> int:
    """Start the servers, collect, write the results, stop the servers; returns the exit status."""
    from nemo_gym.run.supervision.children import StartupError
    from nemo_gym.run.supervision.core import ServerSupervisor
    from nemo_gym.run.supervision.instances import format_instances_table

    instances = validate_global_config(loaded)
    collated = write_inputs(opts, plans)
    print(f"{COMMAND}: {sum(p.n_rows for p in plans)} {opts.split} rows of {len(plans)} agent(s): {collated}")
    supervisor = ServerSupervisor(loaded, instances, stop_event=stop_thread)
    t0 = time.monotonic()
    try:
        try:
            supervisor.start()
        except StartupError as e:
            if stop_thread.is_set():
                sys.stderr.write(f"{COMMAND}: interrupted during server start-up; nothing collected.\n")
                return 130
            sys.stderr.write(scrub(f"{COMMAND}: server start-up failed.\n{e}") + "\n")
            return 1
        print(f"{COMMAND}: {len(supervisor.children)} servers ready ({time.monotonic() - t0:.1f} s)")
        print(format_instances_table(supervisor.server_instances_info()), flush=True)
        head = BaseServerConfig(host=supervisor.head_host, port=supervisor.head_port)
        live = LiveStats()

        async def main() -> tuple[dict[str, dict[str, Any]], bool]:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            if stop_thread.is_set():
                stop.set()
            return await collect_all(opts, plans, head, stop, live), stop.is_set()

        summaries, interrupted = asyncio.run(main())
        _install_signal_handlers(stop_thread)  # asyncio put the defaults back
    finally:
        supervisor.shutdown()
    interrupted = interrupted or any(s.interrupted for s in summaries.values())
    output = Path(opts.output_jsonl_fpath)
    n_lines = write_combined(output, plans)
    metrics = overall_metrics(opts, plans, summaries, interrupted, live)
    metrics_path = sidecar_paths(output)["metrics"]
    write_atomic(metrics_path, json_file_bytes(metrics))
    print(format_overall(metrics))
    print(f"Wrote {output} ({n_lines} rollouts) and {metrics_path}", flush=True)
    if opts.tracker:
        from nemo_gym.collection.tracking import track_run

        track_run(opts.tracker, tracker_config(loaded, opts), metrics, output, run_name=_stem(output).name)
    if interrupted:
        sys.stderr.write(f"{COMMAND}: interrupted; rerun with +resume_from_cache=true to finish.\n")
        return 130
    if any(s.down_servers for s in summaries.values()):
        return EXIT_SERVER_DOWN
    return 1 if metrics["overall"]["rollouts_missing"] else 0


def tracker_config(loaded: LoadedConfig, opts: E2ECollectionConfig) -> dict[str, Any]:
    """The options and tracker keys to hand to the tracker (never the server configs)."""
    from nemo_gym.collection.tracking import OPTION_KEYS

    out: dict[str, Any] = opts.model_dump()
    for key in OPTION_KEYS:
        value = OmegaConf.select(loaded.config, key, default=None)
        if value is not None:
            out[key] = value
    return out


def _install_signal_handlers(stop: StopFlag) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


@command("ng_e2e_collect_rollouts")
def main(argv: list[str] | None = None) -> None:
    """``ng_e2e_collect_rollouts`` (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return
    raise_open_file_limit()
    tune_gc_for_throughput()  # as ng_collect_rollouts does (nemo_gym.server.startup)
    stop = StopFlag()  # not threading.Event: its set() takes a lock, unsafe in a signal handler
    _install_signal_handlers(stop)
    try:
        loaded = load_global_config(argv, expand_env=True)
        add_secret_values(config_secret_values(loaded.config, loaded.env_yaml_data))
        problems = option_problems(loaded, COMMAND)
        if problems:
            raise ConfigError(f"{COMMAND}: unknown options:\n  - " + "\n  - ".join(problems))
        opts = parse_options(loaded)
        plans = make_plan(loaded, opts)
        check_outputs(opts, plans)
        validate_global_config(loaded)  # every server config problem before anything is written
        code = run(loaded, opts, plans, stop)
    except (ConfigError, InputError) as e:
        sys.stderr.write(scrub(str(e).rstrip()) + "\n")
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    main()
