"""What ``ng_run`` hands a server it starts privately: its config and its secrets, in a file only it reads.

Contract
--------
* The launcher writes, for each server it starts, one JSON object of ``{variable name: value}`` (the
  config as YAML under ``NEMO_GYM_CONFIG_DICT``, the cookie-signing secret, the run token, the server's
  own secret values) to a file of its own (mode 0600, in a directory of the run's, mode 0700, removed at
  stop), and puts only that file's path in the server's environment (``NEMO_GYM_LAUNCH_FILE``).
  Nothing of it is in the server's environment, so nothing the server starts (a harness, a sandbox, a
  notebook kernel, any subprocess) inherits it, and no value is bound by the environment's size limits.
* The server reads the file once, first thing (:func:`load_launch_values`, also on the first
  :func:`launch_value`), removes it and drops the variable: a later process of the server finds neither.
* :func:`launch_value` is how every reader gets such a value: the launched value if the server was
  started so, else the process environment (a server started by hand, by a Ray replica actor, or by a
  test that sets the variable).
* A launch file that is missing or unreadable when the variable names it is a ``RuntimeError`` saying so
  (a server must not start without its secrets and fall back to defaults).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

LAUNCH_FILE_ENV_VAR_NAME = "NEMO_GYM_LAUNCH_FILE"

_LOCK = threading.Lock()
_VALUES: dict[str, str] | None = None


def load_launch_values() -> dict[str, str]:
    """This process's launched values (empty when it was not started with a launch file); reads and
    removes the file on the first call."""
    global _VALUES
    with _LOCK:
        if _VALUES is None:
            path = os.environ.pop(LAUNCH_FILE_ENV_VAR_NAME, None)
            _VALUES = _read(Path(path)) if path else {}
        return _VALUES


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"the launch file {path} ({LAUNCH_FILE_ENV_VAR_NAME}) cannot be read: {exc}. A server started by "
            "ng_run reads its config and secrets from it once; it is gone after that first read."
        ) from None
    try:
        path.unlink()
    except OSError:
        pass
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise RuntimeError(f"the launch file {path} does not hold a mapping of names to strings")
    return data


def launch_value(name: str) -> str | None:
    """The launched value of ``name``, else the process environment's."""
    values = load_launch_values()
    return values[name] if name in values else os.environ.get(name)


def write_launch_file(directory: Path, name: str, values: Mapping[str, str]) -> Path:
    """Write ``values`` for the server ``name`` to a new 0600 file in ``directory``; returns its path."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for attempt in range(1000):
        path = directory / f"{name}.{os.getpid()}.{attempt}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(dict(values)).encode())
        return path
    raise RuntimeError(f"cannot create a launch file for {name} in {directory}")
