"""A server process's side of the launcher's promises: it dies with the launcher, and it reports its
config verdict before it serves.

The launcher's side lives in :mod:`nemo_gym.run.supervision` (``verdicts``, ``children``); a server
process imports only this module of it, so servers never load the launcher.

Contract
--------
* :func:`die_with_parent`: under a launcher (``NEMO_GYM_PARENT_PID``) the server process exits when the
  launcher dies, however it dies (parent-death signal plus a watch thread).
* :func:`config_problems` turns a validation error of a config block into problems (``loc``, ``msg``,
  ``type``; an unknown key also ``suggest`` and ``known``, and ``typo_of`` when it reads as a mistyped
  setting: :func:`is_typo_of`); :class:`InstanceConfigError` carries them.
* :func:`report_config_verdict` writes one JSON line ``{"ok", "problems"}`` on the pipe named by
  ``NEMO_GYM_VALIDATION_FDS`` and, if the config is valid, blocks until the launcher writes ``b"g"``
  (any other end of the pipe: the process exits).
* :func:`tune_gc_for_throughput` (called by a server once its app is built, and by ``ng_collect_rollouts``
  before it dispatches): the objects of start-up are frozen out of the garbage collector's scans, and the young generation is collected every
  ``THROUGHPUT_GC_THRESHOLD[0]`` net allocations instead of 700.
* :func:`startup_mark` appends one JSON line ``{"t", "pid", "server", "event"}`` to the file named by
  ``NEMO_GYM_STARTUP_TRACE`` when it is set (``t`` is ``time.monotonic()``, one clock for every process
  of the machine), and does nothing otherwise: the launcher and each server mark the phases of their
  start-up so ``python -m nemo_gym.tools.bench.startup`` can tell where the time goes.
"""

from __future__ import annotations

import difflib
import gc
import os
import signal
import sys
import threading
import time
import typing
from typing import Any

import orjson

from nemo_gym.config.keys import (
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_PARENT_PID_ENV_VAR_NAME,
    NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME,
    NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME,
)

if typing.TYPE_CHECKING:  # the launcher imports this module for startup_mark: no pydantic for it
    from pydantic import BaseModel, ValidationError


class InstanceConfigError(SystemExit):
    """A server instance's config block is invalid; ``problems`` says where and why (for ``ng_run``)."""

    def __init__(self, message: str, problems: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.problems = problems


def loc_text(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``Model``, ``Model | None``, ``list[Model]``...)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def field_names_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) model that ``path`` leads to; [] when it cannot be told."""
    current: type[BaseModel] | None = model
    for part in path:
        if isinstance(part, int):
            continue
        fields = current.model_fields if current is not None else {}
        if part not in fields:
            return []
        current = model_in(fields[part].annotation)
    if current is None:
        return []
    return [f.alias or n for n, f in current.model_fields.items() if n != "name" or current is not model]


def config_problems(model: type[BaseModel], error: ValidationError) -> list[dict[str, Any]]:
    """The errors of validating a config block, each with ``loc`` (dotted), ``msg`` and ``type``;
    an unknown key also with ``suggest`` (close field names), ``typo_of`` (those it reads as a typo of:
    :func:`is_typo_of`) and ``known`` (all field names there)."""
    out = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        item: dict[str, Any] = {"loc": loc_text(loc), "msg": err["msg"], "type": err["type"]}
        if err["type"] == "extra_forbidden" and loc:
            known = sorted(field_names_at(model, loc[:-1]))
            item["known"] = known
            item["suggest"] = difflib.get_close_matches(str(loc[-1]), known, n=3, cutoff=0.6)
            item["typo_of"] = [k for k in item["suggest"] if is_typo_of(str(loc[-1]), k)]
        out.append(item)
    return out


def is_typo_of(key: str, setting: str) -> bool:
    """Whether ``key`` reads as a mistyped ``setting``: a few letters changed, dropped, added or swapped
    (edit distance with transpositions at most 1 for names up to 4 letters, 2 up to 10, else 3).
    ``verified_url`` is not a typo of ``verified``; ``judge_modle_server`` is one of ``judge_model_server``."""
    limit = 1 if len(setting) <= 4 else 2 if len(setting) <= 10 else 3
    if abs(len(key) - len(setting)) > limit:
        return False
    prev2: list[int] = []
    prev = list(range(len(setting) + 1))
    for i, a in enumerate(key, 1):
        row = [i] + [0] * len(setting)
        for j, b in enumerate(setting, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a != b))
            if i > 1 and j > 1 and a == setting[j - 2] and key[i - 2] == b:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1] <= limit


def report_config_verdict(problems: list[dict[str, Any]]) -> bool:
    """Under ng_run: tell the launcher whether this server's config is valid; if it is, wait for its go.

    Returns whether a launcher was told. Without one this returns at once. The wait ends when the
    launcher says go, or this process exits: the launcher closed the pipe (it stopped the run) or
    died (the parent-death signal).
    """
    fds = os.environ.pop(NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME, None)
    if not fds:
        return False
    write_fd, go_fd = (int(x) for x in fds.split(","))
    try:
        payload = orjson.dumps({"ok": not problems, "problems": problems}) + b"\n"
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view) :]
    finally:
        os.close(write_fd)
    if problems:
        os.close(go_fd)
        return True
    go = os.read(go_fd, 1)
    os.close(go_fd)
    if go != b"g":
        os._exit(0)
    return True


def _say_parent_gone(parent_pid: int) -> None:
    try:
        os.write(
            2,
            f"nemo_gym: the launcher (pid {parent_pid}) is gone (parent is now pid {os.getppid()}): exiting\n".encode(),
        )
    except OSError:
        pass


def die_with_parent() -> None:
    """Make this process exit when the launcher dies, however it dies (even SIGKILL)."""
    parent = os.environ.get(NEMO_GYM_PARENT_PID_ENV_VAR_NAME)
    if not parent:
        return
    parent_pid = int(parent)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        _say_parent_gone(parent_pid)
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                _say_parent_gone(parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# The garbage collector's thresholds of a process with many requests in flight. With CPython's default (700 net allocations) an agent with 64
# rollouts in flight, holding each model answer it parsed across its next await, ran a young collection
# every ~20 rollouts, 7-8 % of its CPU (measured with gc.callbacks on example_single_tool_call, 6,000
# rollouts); at 10,000 it ran one in 6,000 rollouts, with no other change. ng_collect_rollouts with 4,096
# in flight spent 22 % of its CPU collecting. Cyclic garbage waits a little longer for its collection: a
# bounded few MB.
THROUGHPUT_GC_THRESHOLD = (10_000, 10, 10)


def tune_gc_for_throughput() -> None:
    """Freeze start-up's objects (imported modules, the built app) out of every later collection's scan,
    and raise the young generation's threshold to :data:`THROUGHPUT_GC_THRESHOLD` (see there for why)."""
    gc.freeze()
    gc.set_threshold(*THROUGHPUT_GC_THRESHOLD)


def startup_mark(event: str, server: str | None = None) -> None:
    """Record that this process reached start-up phase ``event`` (see the module docstring); ``server``
    defaults to this server's instance name (``NEMO_GYM_CONFIG_PATH``), ``"launcher"`` outside one.

    One ``O_APPEND`` write per mark, so the lines of concurrent processes never interleave; a mark costs
    nothing when no trace is asked for, and a trace file that cannot be written is ignored."""
    path = os.environ.get(NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME)
    if not path:
        return
    name = server or os.environ.get(NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME) or "launcher"
    line = orjson.dumps({"t": time.monotonic(), "pid": os.getpid(), "server": name, "event": event}) + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass
