"""The run's command-line entry points (``ng_run``, ``ng_status``, ...) and ``RunHelper``, its Python API.

Every command takes Hydra-style overrides (``+key=value``); configuration problems are printed as
one screen and exit with status 2 before anything starts.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from nemo_gym import __version__
from nemo_gym.auth import AUTH_TOKEN_ENV_VAR_NAME, auth_headers, client_token
from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.config.command import command
from nemo_gym.config.keys import DEFAULT_HEAD_SERVER_HOST, DEFAULT_HEAD_SERVER_PORT, HEAD_SERVER_KEY_NAME
from nemo_gym.config.loading import LoadedConfig, file_override_notes, load_global_config
from nemo_gym.config.options import check_options, no_effect_upstream_keys
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.validation import validate_global_config
from nemo_gym.redaction import add_secret_values, config_secret_values, env_yaml_secret_values, scrub
from nemo_gym.run.supervision.children import StartupError
from nemo_gym.run.supervision.core import ServerSupervisor
from nemo_gym.run.supervision.instances import format_instances_table
from nemo_gym.run.supervision.stop import StopFlag
from nemo_gym.run.zygote import Zygote, wanted_by_argv
from nemo_gym.server.startup import startup_mark

if TYPE_CHECKING:  # RunHelper's and ng_status' types: ng_run loads no pydantic model before spawning
    from nemo_gym.config.parser import GlobalConfigDictParserConfig
    from nemo_gym.config.types import BaseServerConfig

COMMANDS = {
    "ng_run": "Start the head server and every configured server; keep them alive until Ctrl+C.",
    "ng_status": "Show the servers of a running ng_run and whether each answers.",
    "ng_list": "List every environment, agent and model server found (folders and installed packages).",
    "ng_dump_config": "Print the merged, resolved config (secrets redacted) and exit.",
    "ng_test": "Run the tests of one server folder (+entrypoint=<type>/<impl>) or of the whole project.",
    "ng_collect_rollouts": "Run task rows (JSONL) through an agent; write reward-annotated rollouts (JSONL).",
    "ng_e2e_collect_rollouts": "Start the servers, collect rollouts on a split of every agent's datasets, write metrics, stop.",
    "ng_reward_profile": "Per-task reward statistics of a rollouts file (always / never / sometimes solved).",
    "ng_reverify": "Score a saved rollouts file again with today's verifiers; old and new reward side by side.",
    "ng_reward_audit": "Play an adversarial battery against environments' verifiers; fail if any exploit earns.",
    "ng_check_upstream_env": "Run upstream NeMo Gym environment folders here: their tests, start-up, recorded rewards.",
    "ng_export_transitions": "Turn multi-step rollouts into one training row per model turn (reward-to-go).",
    "ng_bench": "Benchmark rollouts/s of an environment on the scripted model against the bare HTTP limit.",
    "ng_bench_sandbox": "Measure what the code sandbox costs per run against the same program run bare.",
    "ng_init_resources_server": "Scaffold a new environment folder (tool, verifier, config, 5 rows, tests, README).",
    "ng_prepare_data": "Validate the datasets a config declares, add agent_ref, write prepared files and metrics.",
    "ng_viewer": "Browse a rollouts file in the browser (trajectories, rewards, comparisons).",
    "ng_quickstart": "Run the example environment on the embedded local model end to end (no API key).",
    "ng_version": "Print the nemo-gym version.",
    "ng_help": "List the ng_* commands.",
}

EXAMPLE_CONFIGS = (
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml,"
    "responses_api_models/scripted_model/configs/scripted_model.yaml"
)


def _help(command: str) -> str:
    """``--help`` of ng_run, ng_status and ng_dump_config: options from the option registry."""
    from nemo_gym.run.cli_help import command_help

    if command == "ng_run":
        return command_help(
            "ng_run",
            COMMANDS["ng_run"],
            'ng_run "+config_paths=[<server config>.yaml,...]" [+env=NAME] [+option=value ...]',
            [
                f'ng_run "+config_paths=[{EXAMPLE_CONFIGS}]"',
                "ng_run +env=example_single_tool_call "
                '"+config_paths=[responses_api_models/scripted_model/configs/scripted_model.yaml]"',
                'ng_run "+config_paths=[...]" +head_server.port=11001 +log_dir=logs +startup_timeout_s=300',
                'ng_run "+config_paths=[...]" +ray_start_local=true     # servers may use Ray (docs/ray.md)',
            ],
            "docs/concepts.md (ng_run), docs/ray.md (Ray), docs/security.md (run token, limits, timeouts)",
        )
    if command == "ng_status":
        return command_help(
            "ng_status",
            COMMANDS["ng_status"] + " Exit status 1 when one does not answer.",
            "ng_status [+head_server.port=PORT]",
            ["ng_status", "ng_status +head_server.port=11001"],
            "docs/concepts.md (ng_run)",
        )
    return command_help(
        "ng_dump_config",
        COMMANDS["ng_dump_config"] + " Takes ng_run's arguments; starts nothing.",
        'ng_dump_config "+config_paths=[<server config>.yaml,...]" [+option=value ...]',
        [f'ng_dump_config "+config_paths=[{EXAMPLE_CONFIGS}]" > merged.yaml'],
        "docs/concepts.md (configuration)",
    )


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(scrub(message.rstrip()) + "\n")
    sys.exit(code)


def _note_no_effect_keys(loaded: LoadedConfig) -> None:
    """One stderr line naming the upstream-only keys that are set (accepted, but nothing reads them),
    and one per value a config file replaced in another's (:func:`file_override_notes`)."""
    for line in file_override_notes(loaded):
        sys.stderr.write(f"nemo_gym: {line}\n")
    keys = no_effect_upstream_keys(loaded.config)
    if keys:
        sys.stderr.write(
            f"nemo_gym: upstream NeMo Gym keys with no effect here, ignored: {', '.join(keys)} "
            "(see docs/trainers.md)\n"
        )


# ------------------------------------------------------------------------------------------------
# ng_run


@command("ng_run")
def run_main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if _wants_help(argv):
        print(_help("ng_run"))
        return
    raise_open_file_limit()
    t0 = time.monotonic()
    startup_mark("main")
    stop = StopFlag()  # not threading.Event: its set() takes a lock, unsafe in a signal handler
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # The fork server imports the servers' shared modules on the other core while the config is read.
    zygote = Zygote.start() if wanted_by_argv(argv) else None

    try:
        loaded = load_global_config(argv, expand_env=True)
        add_secret_values(config_secret_values(loaded.config, loaded.env_yaml_data))  # for _fail's messages
        instances = validate_global_config(loaded)
    except ConfigError as e:
        _fail(str(e))
    startup_mark("config")
    _note_no_effect_keys(loaded)
    if not instances:
        _fail(
            "No server instances configured. Pass +config_paths=[...] with at least one server config "
            "(or +env=<name>; ng_list lists them)."
        )

    supervisor = ServerSupervisor(loaded, instances, stop_event=stop, zygote=zygote)
    try:
        supervisor.start()
    except ConfigError as e:
        _fail(str(e))
    except StartupError as e:
        if received:
            _fail(f"ng_run: stopped by {signal.Signals(received[0]).name} during start-up.", 0)
        _fail(f"ng_run: start-up failed.\n{e}", 1)

    n = supervisor.num_servers()  # local processes and replicas placed on Ray nodes
    print(f"All {n} / {n} servers ready! ({time.monotonic() - t0:.2f} s)")
    print(f"Head server: http://{supervisor.head_host}:{supervisor.head_port}")
    if supervisor.token_file is not None:
        print(
            f"Run token: {supervisor.token_file} (clients on this machine read it; elsewhere set "
            f"{AUTH_TOKEN_ENV_VAR_NAME} to its content)"
        )
    print(format_instances_table(supervisor.server_instances_info()), flush=True)

    exit_code = 0
    while not stop.is_set():
        dead = supervisor.dead_server()
        if dead is not None:
            sys.stderr.write(
                f"ng_run: {supervisor.describe_exit(dead)}\nng_run: stopping the other servers.\n"
            )
            sys.stderr.flush()
            exit_code = 1
            break
        stop.wait(0.2)
    if received:
        print(f"ng_run: received {signal.Signals(received[0]).name}, stopping servers...", flush=True)
    supervisor.shutdown()
    if exit_code == 0:
        print("ng_run: all servers stopped.", flush=True)
    sys.exit(exit_code)


# ------------------------------------------------------------------------------------------------
# RunHelper: the same from Python (trainers, tests).


class RunHelper:
    """Start the servers of a config from Python and stop them again.

    ``RunHelper().start(GlobalConfigDictParserConfig(initial_global_config_dict=..., skip_load_from_cli=True))``
    returns once every server answers; ``shutdown()`` stops them (also done at interpreter exit).
    """

    def __init__(self) -> None:
        self._supervisor: ServerSupervisor | None = None

    def start(self, global_config_dict_parser_config: GlobalConfigDictParserConfig | None = None) -> None:
        from nemo_gym.config.parser import GlobalConfigDictParserConfig

        raise_open_file_limit()
        parser_config = global_config_dict_parser_config or GlobalConfigDictParserConfig()
        if not isinstance(parser_config, GlobalConfigDictParserConfig):
            raise TypeError(
                "RunHelper.start() takes a GlobalConfigDictParserConfig, got "
                f"{type(parser_config).__name__}: GlobalConfigDictParserConfig(initial_global_config_dict=...)"
            )
        loaded = parser_config.load()
        instances = validate_global_config(loaded)
        _note_no_effect_keys(loaded)
        if not instances:
            raise ConfigError(
                "RunHelper.start(): no server instances configured. Give config_paths (in "
                "initial_global_config_dict or +config_paths=[...]) with at least one server config."
            )
        self._supervisor = ServerSupervisor(loaded, instances)
        self._supervisor.start()

    @property
    def supervisor(self) -> ServerSupervisor:
        if self._supervisor is None:
            raise RuntimeError("RunHelper.start() has not been called.")
        return self._supervisor

    @property
    def head_server_config(self) -> BaseServerConfig:
        from nemo_gym.config.types import BaseServerConfig

        return BaseServerConfig(host=self.supervisor.head_host, port=self.supervisor.head_port)

    @property
    def global_config_dict(self):
        return self.supervisor.cfg

    def server_instances(self) -> list[dict]:
        return self.supervisor.server_instances_info()

    def poll(self) -> None:
        """Raise if any server has exited since start."""
        dead = self.supervisor.dead_server()
        if dead is not None:
            raise RuntimeError(self.supervisor.describe_exit(dead))

    def display_server_instance_info(self) -> None:
        print(format_instances_table(self.server_instances()))

    def shutdown(self) -> None:
        if self._supervisor is not None:
            self._supervisor.shutdown()


# ------------------------------------------------------------------------------------------------
# Small commands.


def _head_from_argv(argv: list[str]) -> BaseServerConfig:
    from nemo_gym.config.types import BaseServerConfig

    loaded = load_global_config(argv)
    check_options(loaded, "ng_status")  # it may be given ng_run's arguments: only near-misses are errors
    head = OmegaConf.select(loaded.config, HEAD_SERVER_KEY_NAME, default=None) or {}
    return BaseServerConfig(
        host=head.get("host") or DEFAULT_HEAD_SERVER_HOST,
        port=int(head.get("port") or DEFAULT_HEAD_SERVER_PORT),
    )


@command("ng_status")
def status_main(argv: list[str] | None = None) -> None:
    import httpx

    argv = sys.argv[1:] if argv is None else argv
    if _wants_help(argv):
        print(_help("ng_status"))
        return
    try:
        head = _head_from_argv(argv)
    except ConfigError as e:
        _fail(str(e))
    try:
        headers = auth_headers(client_token(head.port))
        resp = httpx.get(f"{head.base_url}/server_instances", timeout=5, trust_env=False, headers=headers)
    except httpx.HTTPError as e:
        _fail(
            f"No head server answers at {head.base_url} ({e}). Is ng_run running? (+head_server.port=... to choose)",
            1,
        )
    try:
        rows = resp.json() if resp.status_code == 200 else None
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        _fail(
            f"{head.base_url} answered GET /server_instances with HTTP {resp.status_code}, not a server list: "
            "it is not an ng_run head server. (+head_server.port=... to choose)",
            1,
        )
    unhealthy = 0
    for row in rows:
        try:
            ok = httpx.get(row["url"] + "/", timeout=3, trust_env=False, headers=headers).status_code == 200
        except httpx.HTTPError:
            ok = False
        row["health"] = "ok" if ok else "DOWN"
        unhealthy += not ok
    print(f"Head server: {head.base_url}")
    table = format_instances_table(rows).splitlines()
    health = ["health", "------"] + [r["health"] for r in rows]
    print("\n".join(f"{line}  {h}" for line, h in zip(table, health, strict=True)))
    print(f"{len(rows) - unhealthy} / {len(rows)} servers healthy")
    sys.exit(1 if unhealthy else 0)


@command("ng_dump_config")
def dump_config_main(argv: list[str] | None = None) -> None:
    from nemo_gym.run.head_server import redacted_config_yaml

    argv = sys.argv[1:] if argv is None else argv
    if _wants_help(argv):
        print(_help("ng_dump_config"))
        return
    try:
        loaded = load_global_config(argv, expand_env=True)
        validate_global_config(loaded)
    except ConfigError as e:
        _fail(str(e))
    sys.stdout.write(redacted_config_yaml(loaded.config, env_yaml_secret_values(loaded.env_yaml_data)))


@command("ng_version")
def version_main(argv: list[str] | None = None) -> None:
    print(f"nemo-gym {__version__} (python {sys.version.split()[0]})")


@command("ng_help")
def help_main(argv: list[str] | None = None) -> None:
    print(f"nemo-gym {__version__}: commands\n")
    width = max(len(c) for c in COMMANDS)
    for cmd, text in COMMANDS.items():
        print(f"  {cmd.ljust(width)}  {text}")
    print("\nEach takes --help. Docs: docs/concepts.md, docs/writing_an_environment.md")
