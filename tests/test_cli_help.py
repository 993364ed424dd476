"""``--help`` of ng_run, ng_dump_config and ng_status: what the command does, a pasteable example and
every option the command accepts (taken from the option registry the config is checked against), each
with a description."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from nemo_gym.config.options import COMMAND_OPTIONS, HEAD_SERVER_KEYS
from nemo_gym.run.cli import dump_config_main, run_main, status_main
from nemo_gym.run.cli_help import instance_keys, option_help

MAINS = {"ng_run": run_main, "ng_dump_config": dump_config_main, "ng_status": status_main}


def _accepted(command: str) -> list[str]:
    out = []
    for key in sorted(COMMAND_OPTIONS[command]):
        out += [f"head_server.{k}" for k in sorted(HEAD_SERVER_KEYS)] if key == "head_server" else [key]
    return out


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    MAINS[command](["--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(MAINS))
def test_help_lists_every_option_with_a_description(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(command, capsys)
    assert text.startswith(f"{command}: ") and "usage:" in text and "Examples:" in text
    missing = [k for k in _accepted(command) if f"+{k}=" not in text]
    assert not missing, f"{command} --help does not list: {missing}"
    described = option_help()
    undescribed = [k for k in _accepted(command) if not described.get(k, ("", ""))[1]]
    assert not undescribed, f"options without a description in nemo_gym.run.cli_help: {undescribed}"
    assert "(undescribed)" not in text


def test_ng_run_help_names_the_per_instance_keys_and_ray(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("ng_run", capsys)
    for key in (
        "log_dir",
        "startup_timeout_s",
        "shutdown_timeout_s",
        "ray_start_local",
        "ray_head_node_address",
    ):
        assert f"+{key}=" in text
    flat = " ".join(text.split())
    assert all(k in flat for k in instance_keys()) and "num_replicas" in flat and "ray_resources" in flat


def test_ng_dump_config_example_is_pasteable(capsys: pytest.CaptureFixture[str]) -> None:
    """The first example of ng_dump_config --help runs as shown (the config it names exists)."""
    text = _help("ng_dump_config", capsys)
    example = text.split("Examples:\n", 1)[1].splitlines()[0].strip()
    argv = shlex.split(example.split(">", 1)[0])
    assert argv[0] == "ng_dump_config"
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from nemo_gym.run.cli import dump_config_main; dump_config_main(sys.argv[1:])",
         *argv[1:]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "example_single_tool_call_simple_agent:" in done.stdout and "policy_model:" in done.stdout
