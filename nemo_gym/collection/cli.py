"""``ng_collect_rollouts``: the command line around :func:`~nemo_gym.collection.collector.collect_rollouts`.

Contract
--------
* Options are ``+key=value`` overrides (and config files) loaded by :mod:`nemo_gym.config.process`;
  an unknown command-line key, an invalid option or a bad input file exits 2 with a message and
  nothing sent or written. Known secret values are registered for scrubbing before anything runs.
* The input is validated before any server is contacted; SIGINT/SIGTERM stop cleanly (nothing new
  starts, in-flight rollouts are cancelled, the output keeps whole lines) and HTTP sessions close.
* Exit status: 0 all done, 1 rollouts missing after failures, 2 bad input or options, 3
  (``EXIT_SERVER_DOWN``) stopped early because a server is down, 130 interrupted. The summary is
  printed (and, with ``+tracker``, exported).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.collection.circuit_breaker import describe_down
from nemo_gym.collection.collector import collect_rollouts, format_summary
from nemo_gym.collection.options import InputError, RolloutCollectionConfig
from nemo_gym.collection.row_schema import check_input
from nemo_gym.collection.summary import CollectionSummary
from nemo_gym.config.command import command
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.redaction import add_secret_values, config_secret_values
from nemo_gym.server.startup import tune_gc_for_throughput

# Exit status when dispatch stopped because a server is down (restart it, then resume).
EXIT_SERVER_DOWN = 3


@command("ng_collect_rollouts")
def collect_main(argv: list[str] | None = None) -> None:
    """``ng_collect_rollouts``. Exit status: 0 all rollouts done, 1 some missing (failures), 2 bad
    input or options (nothing sent), 3 stopped early because a server is down, 130 interrupted
    (for 1, 3 and 130: rerun with ``+resume_from_cache=true``)."""
    from omegaconf import OmegaConf

    from nemo_gym.config.keys import HEAD_SERVER_KEY_NAME
    from nemo_gym.config.loading import load_global_config
    from nemo_gym.config.options import COMMAND_OPTIONS, option_problems
    from nemo_gym.config.overrides import parse_cli_overrides

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_collect_rollouts +agent_name=<agent> +input_jsonl_fpath=<in.jsonl> +output_jsonl_fpath=<out.jsonl>\n"
            "  [+limit=N] [+num_repeats=K] [+num_samples_in_parallel=P] [+num_repeats_add_seed=true]\n"
            "  [+responses_create_params.temperature=0.7 ...] [+resume_from_cache=true] [+max_attempts=3]\n"
            "  [+overwrite=true] [+pass_threshold=1.0] [+request_timeout_s=3600] [+progress=false]\n"
            "  [+head_server.host=127.0.0.1 +head_server.port=11000]\n"
            "  [+circuit_breaker_threshold=3] [+tracker=mlflow|wandb (docs/concepts.md: Experiment tracking)]\n"
            "  [+observability_enabled=true|false (model calls to <stem>_model_calls.jsonl; docs/trainers.md)]\n"
            "  [+metrics_port=PORT (live stats on GET http://127.0.0.1:PORT/metrics while it runs; 0: a free\n"
            "    port, printed at start; default off; docs/observability.md)]\n"
            "exit status: 0 all done, 1 some rollouts missing (see the failures file), 2 bad input or options,\n"
            "  3 stopped early because a server is down (restart it, then +resume_from_cache=true), 130 interrupted"
        )
        return
    raise_open_file_limit()
    tune_gc_for_throughput()  # after the imports: their objects are frozen out of every collection
    try:
        cli_keys = {o.key.split(".")[0] for o in parse_cli_overrides(argv) if not o.delete}
        loaded = load_global_config(argv)
        add_secret_values(config_secret_values(loaded.config, loaded.env_yaml_data))  # scrubbed from failures
        # Every key on the command line must be an option; config files and env.yaml are shared with
        # other tools, so only their near-misses of an option are reported.
        problems = option_problems(loaded, "ng_collect_rollouts", strict_cli=True)
        container = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        sys.stderr.write(str(e) + "\n")
        sys.exit(2)
    if problems:
        unknown = sorted("+" + k for k in cli_keys if k not in COMMAND_OPTIONS["ng_collect_rollouts"])
        sys.stderr.write(
            f"ng_collect_rollouts: unknown option(s): {', '.join(unknown) or 'see below'}. See --help.\n  - "
            + "\n  - ".join(problems)
            + "\n"
        )
        sys.exit(2)
    head = container.pop(HEAD_SERVER_KEY_NAME, None) or {}
    fields = {k: v for k, v in container.items() if k in RolloutCollectionConfig.model_fields}
    try:
        cfg = RolloutCollectionConfig.model_validate(fields)
    except ValidationError as e:
        msgs = [f"+{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        sys.stderr.write("ng_collect_rollouts: invalid options:\n  " + "\n  ".join(msgs) + "\n")
        sys.exit(2)
    try:
        head_cfg = BaseServerConfig(host=head.get("host") or "127.0.0.1", port=int(head.get("port") or 11000))
    except (TypeError, ValueError, ValidationError) as e:
        sys.stderr.write(f"ng_collect_rollouts: invalid +head_server: {e}\n")
        sys.exit(2)
    try:
        summary = asyncio.run(_collect_with_signals(cfg, head_cfg))
    except (InputError, ConnectionError) as e:
        sys.stderr.write(f"ng_collect_rollouts: {e}\n")
        sys.exit(2)
    print(format_summary(summary), flush=True)
    if cfg.tracker:
        from nemo_gym.collection.tracking import track_run

        out = Path(cfg.output_jsonl_fpath)
        track_run(cfg.tracker, container, summary.to_dict(), out, run_name=out.stem, e2e=False)
    if summary.interrupted:
        sys.exit(130)
    if summary.down_servers:
        for d in summary.down_servers:
            sys.stderr.write(f"ng_collect_rollouts: stopped early: {describe_down(d)}.\n")
        sys.stderr.write(
            f"ng_collect_rollouts: {summary.not_attempted} rollout(s) not attempted, "
            f"{summary.this_run.failed} failed; restart the server(s), then rerun with +resume_from_cache=true.\n"
        )
        sys.exit(EXIT_SERVER_DOWN)
    sys.exit(1 if summary.rollouts_missing else 0)


async def _collect_with_signals(cfg: RolloutCollectionConfig, head: BaseServerConfig) -> CollectionSummary:
    """Check the input (its format errors are reported even when no head server answers), then collect;
    SIGINT/SIGTERM stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    connect = functools.partial(ServerClient.load_from_global_config, head, timeout_s=cfg.request_timeout_s)
    try:
        checked = await check_input(cfg, connect)
        return await collect_rollouts(cfg, checked.client, stop, checked=checked)
    finally:
        await close_shared_session()
