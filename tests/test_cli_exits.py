"""Every ``ng_*`` command ends the same way when its reader goes away or the user presses Ctrl+C
(:mod:`nemo_gym.config.command`): no traceback, exit 141 or 130."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib

import pytest

from nemo_gym.config.command import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR

SCRIPTS = tomllib.loads((PACKAGE_PARENT_DIR / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_entry_point_goes_through_the_command_wrapper(name: str) -> None:
    module, _, attr = SCRIPTS[name].partition(":")
    main = getattr(importlib.import_module(module), attr)
    assert getattr(main, "__wrapped__", None) is not None, (
        f"{name} ({SCRIPTS[name]}) is not wrapped by @command"
    )


def _closed_pipe_run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` with stdout a pipe whose reader has already gone (what ``| head`` leaves behind)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("name", ["ng_help", "ng_reward_profile", "ng_collect_rollouts"])
def test_output_into_a_closed_pipe_ends_quietly(name: str) -> None:
    """Before: ``ng_help | head -1`` could end in a BrokenPipeError traceback (exit 1)."""
    module, _, attr = SCRIPTS[name].partition(":")
    code = f"import sys; from {module} import {attr} as main; main(['--help'])"
    done = _closed_pipe_run([sys.executable, "-c", code])
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr.decode()[-2000:]
    assert b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, done.stderr.decode()


def test_a_ctrl_c_that_escapes_a_command_is_one_line_and_130(capsys: pytest.CaptureFixture[str]) -> None:
    @command("ng_probe")
    def main(argv: list[str] | None = None) -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "ng_probe: interrupted\n"


def test_a_commands_own_exit_status_passes_through() -> None:
    @command("ng_probe")
    def main(argv: list[str] | None = None) -> None:
        raise SystemExit(2)

    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
