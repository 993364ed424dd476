"""The real ``ng_dump_config`` and ``ng_run`` commands on good and bad configs, as subprocesses.

A bad config must make either command exit with status 2, print one screen naming the file:line or
key to change, and (for ``ng_run``) start nothing: no ready line, no process left carrying the
launch's marker, and the ``log_dir`` that the supervisor creates just before spawning the first
server is never created. A positive control shows those signals do appear on a good config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from nemo_gym.redaction import REDACTED
from tests.conftest import BIN_DIR, READY_RE, Launcher

SUBPROCESS_TIMEOUT_S = 120  # a bound on each wait on a busy machine, not a speed check
MAX_ERROR_LINES = 40  # rows of a terminal SCREEN_WIDTH columns wide
SCREEN_WIDTH = 120

SERVERS_YAML = """\
example_single_tool_call:
  resources_servers:
    example_single_tool_call:
      entrypoint: app.py
policy_model:
  responses_api_models:
    scripted_model:
      entrypoint: app.py
my_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: example_single_tool_call}
      model_server: {type: responses_api_models, name: polcy_model}
"""


def command(name: str) -> str:
    """The path of an ``ng_*`` console script of the interpreter running the tests."""
    path = BIN_DIR / name
    assert path.is_file(), f"{path} is missing; install the project (pip install -e .) into this venv"
    return str(path)


def child_env() -> dict[str, str]:
    """The current environment without anything a surrounding ng_run may have set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_")}


def run_cli(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``ng_*`` to completion in ``cwd`` (bounded by SUBPROCESS_TIMEOUT_S)."""
    return subprocess.run(
        [command(name), *args],
        cwd=cwd,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def write_files(directory: Path, files: dict[str, str]) -> None:
    """Write each dedented file of ``files`` (name -> text) into ``directory``."""
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@dataclass
class BadCase:
    """A bad config, the arguments that load it, and words its error must contain."""

    files: dict[str, str]
    args: list[str]
    expected: list[str] = field(default_factory=list)


BAD_CASES: dict[str, BadCase] = {
    "missing_values": BadCase(
        {
            "model.yaml": """\
            policy_model:
              responses_api_models:
                scripted_model:
                  entrypoint: app.py
                  base_url: ${policy_base_url}
                  api_key: ${policy_api_key}
            must_set: ???
            """
        },
        ["+config_paths=[model.yaml]"],
        [
            "Missing or unresolvable values (3)",
            "++policy_base_url=<value>",
            "++policy_api_key=<value>",
            "++must_set=<value>",
            "policy_model.responses_api_models.scripted_model.base_url (model.yaml:5)",
            "??? at model.yaml:7",
        ],
    ),
    "reference_to_missing_instance": BadCase(
        {"servers.yaml": SERVERS_YAML},
        ["+config_paths=[servers.yaml]"],
        [
            "'my_agent.responses_api_agents.simple_agent.model_server' (servers.yaml:14)",
            "Did you mean 'policy_model'?",
        ],
    ),
    "impl_folder_missing": BadCase(
        {"a.yaml": "env:\n  resources_servers:\n    zz_made_up_env:\n      entrypoint: app.py\n"},
        ["+config_paths=[a.yaml]"],
        ["'env.resources_servers.zz_made_up_env' (a.yaml:3)", "no folder resources_servers/zz_made_up_env/"],
    ),
    "malformed_yaml": BadCase(
        {"bad.yaml": "ok: 1\nlist: [1, 2\nnext: 3\n"},
        ["+config_paths=[bad.yaml]"],
        ["Malformed YAML at bad.yaml:3:5", "started at line 2"],
    ),
    "malformed_env_yaml": BadCase(
        {"env.yaml": "policy_base_url: http://x\n  policy_api_key: k\n"},
        [],
        ["Malformed YAML at env.yaml:2"],
    ),
    "misspelled_server_type": BadCase(
        {"a.yaml": "env:\n  resource_servers:\n    example_single_tool_call:\n      entrypoint: app.py\n"},
        ["+config_paths=[a.yaml]"],
        ["'env' (a.yaml:2)", "'resource_servers' is not a server type", "Did you mean 'resources_servers'?"],
    ),
    "server_type_as_top_level_key": BadCase(
        {"a.yaml": "responses_api_models:\n  scripted_model:\n    entrypoint: app.py\n"},
        ["+config_paths=[a.yaml]"],
        ["'responses_api_models' (a.yaml:1) is a server type", "Nest it under an instance name"],
    ),
    "entrypoint_without_server_type": BadCase(
        {"a.yaml": "my_model:\n  scripted_model:\n    entrypoint: app.py\n"},
        ["+config_paths=[a.yaml]"],
        ["'my_model' (a.yaml:1)", "no server type", "responses_api_models"],
    ),
    "config_path_does_not_exist": BadCase(
        {}, ["+config_paths=[no_such_config.yaml]"], ["'no_such_config.yaml'", "does not exist"]
    ),
    "nested_config_path_does_not_exist": BadCase(
        {"top.yaml": "config_paths: [gone.yaml]\n"},
        ["+config_paths=[top.yaml]"],
        ["'gone.yaml' (listed in top.yaml:1) does not exist"],
    ),
    "sweep_override": BadCase({}, ["++policy_model_name=a,b"], ["sweep", "not supported"]),
    "unparsable_override": BadCase({}, ["+config_paths=[a.yaml"], ["Cannot parse command-line override"]),
    "misspelled_launcher_option": BadCase(
        {},
        ["+startup_timout_s=5"],
        [
            "'startup_timout_s' (command-line override `+startup_timout_s=5`)",
            "Did you mean 'startup_timeout_s'?",
        ],
    ),  # fmt: skip
    "misspelled_launcher_option_in_a_file": BadCase(
        {"a.yaml": "policy_model_name: x\nshutdown_timeout: 5\n"},
        ["+config_paths=[a.yaml]"],
        ["'shutdown_timeout' (a.yaml:2)", "Did you mean 'shutdown_timeout_s'?"],
    ),
    "misspelled_head_server_setting": BadCase(
        {}, ["+head_server.prot=11001"], ["'head_server.prot'", "Did you mean 'head_server.port'?"]
    ),
    "delete_unknown_key": BadCase(
        {"a.yaml": "policy_model_name: x\n"},
        ["+config_paths=[a.yaml]", "~policy_modl_name"],
        ["~policy_modl_name", "Did you mean 'policy_model_name'?"],
    ),
}


def assert_one_screen_error(result: subprocess.CompletedProcess[str], expected: list[str]) -> None:
    """Exit status 2, nothing on stdout, and a short stderr containing every expected phrase."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    rows = sum(max(1, -(-len(line) // SCREEN_WIDTH)) for line in result.stderr.splitlines())
    assert 0 < rows <= MAX_ERROR_LINES, result.stderr
    for words in expected:
        assert words in result.stderr, f"{words!r} not in:\n{result.stderr}"


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_ng_dump_config_rejects_bad_config(tmp_path: Path, case: str) -> None:
    bad = BAD_CASES[case]
    write_files(tmp_path, bad.files)
    assert_one_screen_error(run_cli("ng_dump_config", bad.args, tmp_path), bad.expected)


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_ng_run_rejects_bad_config_and_starts_nothing(tmp_path: Path, launch: Launcher, case: str) -> None:
    bad = BAD_CASES[case]
    write_files(tmp_path, bad.files)
    log_dir = tmp_path / "ng_run_logs"
    run = launch(*bad.args, f"++log_dir={log_dir}", "++head_server.port=0", cwd=tmp_path)
    code = run.wait_exit(SUBPROCESS_TIMEOUT_S)
    assert_one_screen_error(
        subprocess.CompletedProcess(run.proc.args, code, run.stdout, run.stderr), bad.expected
    )
    assert READY_RE.search(run.output) is None
    assert not log_dir.exists()  # created just before the first server is spawned
    assert run.our_processes() == []  # no server process outlived the failed start


def test_ng_run_without_server_instances(tmp_path: Path, launch: Launcher) -> None:
    write_files(tmp_path, {"a.yaml": "policy_model_name: x\n"})
    log_dir = tmp_path / "logs"
    run = launch("+config_paths=[a.yaml]", f"++log_dir={log_dir}", cwd=tmp_path)
    code = run.wait_exit(SUBPROCESS_TIMEOUT_S)
    result = subprocess.CompletedProcess(run.proc.args, code, run.stdout, run.stderr)
    assert_one_screen_error(result, ["No server instances configured", "+config_paths=[...]"])
    assert not log_dir.exists()


# --------------------------------------------------------------------------------------------------
# Good configs.

SECRET_API_KEY = "sk-test-0123456789abcdef"


def test_ng_dump_config_prints_merged_resolved_redacted_config(tmp_path: Path) -> None:
    write_files(
        tmp_path,
        {
            "env.yaml": f"policy_base_url: http://127.0.0.1:9/v1\npolicy_api_key: {SECRET_API_KEY}\n",
            "model.yaml": """\
            config_paths: [resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml]
            shared_base_url: http://127.0.0.1:8/v1
            policy_model:
              responses_api_models:
                scripted_model:
                  entrypoint: app.py
                  base_url: ${shared_base_url}
                  env_url: ${policy_base_url}
                  api_key: ${policy_api_key}
                  headers: {Authorization: "Bearer ${policy_api_key}", X-Org: org-0123456789}
                  auth_line: "key=${policy_api_key}"
                  hf_token: hf_0123456789
                  clientSecret: cs_0123456789
                  password: hunter2-password
                  max_tokens: 100
                  max_output_tokens: 50
                  tokenizer: gpt2
                  return_token_id_information: true
                  temperature: 1.0
            """,
        },
    )
    result = run_cli(
        "ng_dump_config",
        ["+config_paths=[model.yaml]", "++policy_model_name=m", "++extra.temperature=0.25"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    dumped = yaml.safe_load(result.stdout)
    model = dumped["policy_model"]["responses_api_models"]["scripted_model"]
    assert model["base_url"] == "http://127.0.0.1:8/v1"  # interpolation resolved
    for key in ("api_key", "hf_token", "clientSecret", "password"):
        assert model[key] == REDACTED, key
    assert dumped["policy_api_key"] == REDACTED
    # env.yaml's secrets are its credentials: the key is hidden, the endpoint's URL stays readable.
    assert (
        dumped["policy_base_url"] == "http://127.0.0.1:9/v1" and model["env_url"] == "http://127.0.0.1:9/v1"
    )
    assert model["headers"] == {"Authorization": REDACTED, "X-Org": REDACTED}  # every header value
    assert model["auth_line"] == f"key={REDACTED}"  # a secret inside another string is cut out
    assert (model["max_tokens"], model["max_output_tokens"]) == (100, 50)
    assert (model["tokenizer"], model["return_token_id_information"]) == ("gpt2", True)
    for secret in (SECRET_API_KEY, "hf_0123456789", "cs_0123456789", "hunter2-password", "org-0123456789"):
        assert secret not in result.stdout
    # Merged: the transitively included environment config, env.yaml and the command line.
    assert "example_single_tool_call_simple_agent" in dumped
    assert (dumped["policy_model_name"], dumped["extra"]["temperature"]) == ("m", 0.25)
    assert "config_paths" not in dumped


def test_ng_dump_config_applies_precedence_and_deletion(tmp_path: Path) -> None:
    write_files(
        tmp_path,
        {
            "a.yaml": "from_yaml: yaml\nyaml_env: yaml\nall_three: yaml\ndropped: 1\n",
            "env.yaml": "yaml_env: env\nall_three: env\n",
        },
    )
    result = run_cli("ng_dump_config", ["+config_paths=[a.yaml]", "++all_three=cli", "~dropped"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == {"from_yaml": "yaml", "yaml_env": "env", "all_three": "cli"}


def test_ng_run_positive_control_creates_log_dir_and_prints_ready(tmp_path: Path, launch: Launcher) -> None:
    """The 'starts nothing' checks above are meaningful: on a good config all three signals appear."""
    write_files(
        tmp_path,
        {"model.yaml": "m:\n  responses_api_models:\n    scripted_model:\n      entrypoint: app.py\n"},
    )
    log_dir = tmp_path / "ng_run_logs"
    run = launch("+config_paths=[model.yaml]", f"++log_dir={log_dir}", "++head_server.port=0", cwd=tmp_path)
    assert run.wait_ready(SUBPROCESS_TIMEOUT_S) == 1
    assert log_dir.is_dir()
    assert len(run.our_processes()) >= 2  # ng_run and its server
    run.send_signal(signal.SIGINT)
    code = run.wait_exit(SUBPROCESS_TIMEOUT_S)
    assert code == 0, f"exit code {code} after SIGINT\n{run.output}"


# --------------------------------------------------------------------------------------------------
# Typos inside server blocks: each server checks its block against its config class, and ng_run
# lets none of them start until all have passed.

MARKER_APP = """
from pathlib import Path

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class MarkerConfig(BaseResourcesServerConfig):
    marker_path: str


class MarkerServer(SimpleResourcesServer):
    config: MarkerConfig

    async def on_startup(self) -> None:
        Path(self.config.marker_path).write_text("started")

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    MarkerServer.run_webserver()
"""


def test_ng_run_typos_in_server_blocks_stop_the_run_before_any_server_starts(
    tmp_path: Path, launch: Launcher
) -> None:
    marker = tmp_path / "marker_started"
    write_files(
        tmp_path,
        {
            "resources_servers/marker_probe/app.py": MARKER_APP,
            "servers.yaml": f"""\
            marker:
              resources_servers:
                marker_probe:
                  entrypoint: app.py
                  marker_path: {marker}
            policy_model:
              responses_api_models:
                scripted_model:
                  entrypoint: app.py
            my_agent:
              responses_api_agents:
                simple_agent:
                  entrypoint: app.py
                  resources_server: {{type: resources_servers, name: marker}}
                  model_server: {{type: responses_api_models, name: policy_model}}
                  max_stpes: 5
                  datasets:
                    - {{name: example, type: example, jsonl_fpth: data/example.jsonl}}
            """,
        },
    )
    log_dir = tmp_path / "ng_run_logs"
    typo = "++policy_model.responses_api_models.scripted_model.return_token_id_informaton=true"
    run = launch(
        "+config_paths=[servers.yaml]", typo, f"++log_dir={log_dir}", "++head_server.port=0", cwd=tmp_path
    )
    code = run.wait_exit(SUBPROCESS_TIMEOUT_S)
    assert code == 2, f"exit code {code}\n{run.output}"
    err = run.stderr
    assert "no server was started" in err and "Traceback" not in err, err
    assert "'my_agent.responses_api_agents.simple_agent.max_stpes' (servers.yaml:16)" in err, err
    assert "Did you mean 'max_steps'?" in err, err
    assert "'my_agent.responses_api_agents.simple_agent.datasets[0].jsonl_fpth' (servers.yaml:17)" in err, err
    assert "Did you mean 'jsonl_fpath'?" in err, err
    assert f"(command-line override `{typo}`)" in err, err
    assert "Did you mean 'return_token_id_information'?" in err, err
    assert READY_RE.search(run.output) is None
    assert not marker.exists()  # the valid server's start-up hook never ran
    assert run.our_processes() == []


def test_a_key_close_to_no_setting_is_ignored_and_said_as_upstream_ignores_it(
    tmp_path: Path, launch: Launcher
) -> None:
    """Upstream's configs carry keys their own config class never declared (``dataset_name``, ``env``):
    upstream ignores them, so its environments start there. Here they start too, with a line naming the
    key (before: refused like a typo). A key close to a setting's name stays an error (test above)."""
    marker = tmp_path / "marker_started"
    write_files(
        tmp_path,
        {
            "resources_servers/marker_probe/app.py": MARKER_APP,
            "servers.yaml": f"""\
            marker:
              resources_servers:
                marker_probe:
                  entrypoint: app.py
                  marker_path: {marker}
                  dataset_name: an_upstream_leftover
                  marker_path_url: close_to_a_setting_but_no_typo
            """,
        },
    )
    run = launch("+config_paths=[servers.yaml]", "++head_server.port=0", cwd=tmp_path)
    assert run.wait_ready() == 1
    assert marker.read_text() == "started"
    line = next((x for x in run.output.splitlines() if "ignoring 'dataset_name'" in x), None)
    assert line is not None and "resources_servers/marker_probe" in line, run.output
    # Close to a setting but no typo of it (upstream's code_gen config carries verified_url beside
    # verified): ignored too, and the line says which setting it is not.
    assert "'marker_path_url'" in line and "'marker_path_url' is not 'marker_path'" in line, line


@pytest.mark.parametrize(
    "cmd, args, expected",
    [
        ("ng_collect_rollouts", ["+input_jsonl_fpath=in.jsonl", "+output_jsonl_fpath=out.jsonl", "+num_repeat=3"],
         "Did you mean '+num_repeats'"),
        ("ng_reward_profile", ["+jsonl_fpath=in.jsonl", "+pass_treshold=0.5"], "Did you mean '+pass_threshold'?"),
        ("ng_viewer", ["+jsonl_fpth=in.jsonl"], "+jsonl_fpth: unknown option. Did you mean '+jsonl_fpath'"),
        ("ng_bench", ["+env=no_such_env", "+num_rollout=5"], "Did you mean '+num_rollouts'?"),
        # (if the typo went unnoticed, pytest would only be asked to collect a file that does not exist)
        ("ng_test", ["+entrypiont=resources_servers/example_single_tool_call", "--", "--co", "no_such_test.py"],
         "Did you mean '+entrypoint'?"),
    ],
    ids=["collect", "reward_profile", "viewer", "bench", "test"],
)  # fmt: skip
def test_other_commands_name_a_mistyped_option(
    tmp_path: Path, cmd: str, args: list[str], expected: str
) -> None:
    (tmp_path / "in.jsonl").write_text("")
    result = run_cli(cmd, args, tmp_path)
    assert result.returncode != 0, result.stdout
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out.jsonl").exists()
