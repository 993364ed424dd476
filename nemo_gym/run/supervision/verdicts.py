"""The config-verdict protocol: every server checks its config block, then all go on together.

One place for both sides of the pipe pair named by ``NEMO_GYM_VALIDATION_FDS``.

Contract
--------
* The server's side (run in each server process by ``BaseServer.run_webserver``):
  :func:`config_problems` turns a validation error of a config block into problems (``loc``, ``msg``,
  ``type``; an unknown key also ``suggest`` and ``known``); :class:`InstanceConfigError` carries them;
  :func:`report_config_verdict` writes one JSON line ``{"ok", "problems"}`` and, if the config is
  valid, blocks until the launcher writes ``b"g"`` (any other end of the pipe: the process exits).
* The launcher's side (:class:`VerdictsMixin`, part of the supervisor): collect every local child's
  and Ray replica's verdict within the start-up bound; if any config is invalid, raise one
  ``ConfigError`` listing every problem with the file:line of its key and "did you mean", and let
  nothing serve; else tell every child to go. A child that exits or stays silent past the bound is a
  :class:`~nemo_gym.run.supervision.children.StartupError` naming it with its last log lines.
"""

from __future__ import annotations

import difflib
import json
import os
import selectors
import time
import typing
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from nemo_gym.global_config import NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME, ConfigError, ServerInstance
from nemo_gym.run.supervision.children import ChildServer, StartupError


# -- the server's side ------------------------------------------------------------------------------
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


# -- the launcher's side ----------------------------------------------------------------------------
class VerdictsMixin:
    """Collecting the children's config verdicts (mixed into :class:`ServerSupervisor`)."""

    def _wait_config_verdicts(self, deadline: float) -> None:
        """Collect every child's config verdict; raise ConfigError listing all problems, else let all go."""
        pending = {c.verdict_fd: c for c in self.children if c.verdict_fd is not None}
        silent: list[ChildServer] = []  # closed its pipe without a verdict: it exited (or never checks)
        # A selector (epoll where there is one), not select.select: a trainer process that starts servers
        # through RunHelper may hold more than 1,024 open files, and select() refuses descriptors >= 1024.
        selector = selectors.DefaultSelector()
        for fd in pending:
            selector.register(fd, selectors.EVENT_READ)
        try:
            self._read_verdicts(pending, silent, selector, deadline)
        finally:
            selector.close()
        problems = list(  # replicas of one instance report the same problems once
            dict.fromkeys(
                p
                for c in self.children
                if c.verdict and not c.verdict.get("ok")
                for p in self._problems_of(c)
            )
        )
        problems += [p for p in self._ray_config_problems(deadline) if p not in problems]
        if problems:
            raise ConfigError(
                f"The configuration of {'a server is' if len(problems) == 1 else 'the servers is'} not valid "
                f"({len(problems)} problem{'s' if len(problems) != 1 else ''}; no server was started):\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        for child in self.children:
            self._close_go(child, go=True)
        for group in self.ray_groups.values():
            group.go()

    def _ray_config_problems(self, deadline: float) -> list[str]:
        """The config problems Ray-placed replicas reported (their servers check their blocks on their
        nodes, as local ones do); replicas of one instance report the same problems once."""
        if not self.ray_groups:
            return []
        from nemo_gym.run.ray.replicas import RayPlacementError

        problems: list[str] = []
        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None:
                continue
            try:
                verdicts = group.wait_verdicts(deadline)
            except RayPlacementError as e:
                raise StartupError(str(e)) from None
            for verdict in verdicts:
                if verdict and not verdict.get("ok"):
                    problems += [p for p in self._verdict_problems(inst, verdict) if p not in problems]
        return problems

    def _read_verdicts(
        self,
        pending: dict[int, ChildServer],
        silent: list[ChildServer],
        selector: selectors.BaseSelector,
        deadline: float,
    ) -> None:
        while pending:
            if self.stop_event.is_set():
                raise StartupError("Start-up interrupted.")
            readable = [key.fd for key, _ in selector.select(0.05)]
            for fd in readable:
                child = pending[fd]
                data = os.read(fd, 65536)
                child.verdict_buf += data
                if b"\n" in child.verdict_buf or not data:
                    line = child.verdict_buf.partition(b"\n")[0]
                    try:
                        child.verdict = json.loads(line) if line else None
                    except ValueError:
                        child.verdict = None
                    if child.verdict is None:
                        silent.append(child)
                    selector.unregister(fd)
                    os.close(fd)
                    child.verdict_fd = None
                    del pending[fd]
            for child in [*silent, *pending.values()]:
                if child.process is not None and child.process.poll() is not None:
                    raise StartupError(self.describe_exit(child, during_startup=True))
            if pending and time.monotonic() > deadline:
                waiting = list(pending.values())
                details = "\n".join(self._tail_text(c) for c in waiting)
                raise StartupError(
                    f"Timed out after {self.startup_timeout_s:g} s waiting for "
                    f"{', '.join(c.name for c in waiting)} to load and check its config "
                    f"(raise +startup_timeout_s=... if it is just slow).\n{details}"
                )

    def _problems_of(self, child: ChildServer) -> list[str]:
        """One line per problem a child reported, with the file:line of the key and "did you mean"."""
        assert child.verdict is not None
        return self._verdict_problems(child.instance, child.verdict)

    def _verdict_problems(self, instance: ServerInstance, verdict: dict[str, Any]) -> list[str]:
        key = instance.config_key
        out = []
        for p in verdict.get("problems") or [{"loc": "", "msg": "invalid config"}]:
            loc = str(p.get("loc") or "")
            dotted = f"{key}.{loc}" if loc and not loc.startswith("[") else key + loc
            where = self.loaded.provenance.where(dotted)
            at = f" ({where})" if where else ""
            if p.get("type") == "extra_forbidden":
                suggest = p.get("suggest") or []
                known = p.get("known") or []
                hint = (
                    " Did you mean " + " or ".join(f"'{s}'" for s in suggest) + "?"
                    if suggest
                    else (f" Known keys: {', '.join(known)}." if known else "")
                )
                out.append(
                    f"'{dotted}'{at}: {instance.folder} has no setting '{loc.rpartition('.')[2]}'.{hint}"
                )
            else:
                out.append(f"'{dotted}'{at}: {p.get('msg')}")
        return out

    @staticmethod
    def _close_go(child: ChildServer, go: bool) -> None:
        if child.go_fd is None:
            return
        try:
            if go:
                os.write(child.go_fd, b"g")
        except OSError:  # the child is gone (or never listens): it is watched like any other
            pass
        finally:
            os.close(child.go_fd)
            child.go_fd = None
