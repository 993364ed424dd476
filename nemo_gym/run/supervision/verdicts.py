"""The config-verdict protocol: every server checks its config block, then all go on together.

The launcher's side of the pipe pair named by ``NEMO_GYM_VALIDATION_FDS``.

Contract
--------
* The server's side (run in each server process by ``BaseServer.run_webserver``) is
  :mod:`nemo_gym.server.startup`: ``config_problems``, ``InstanceConfigError`` and
  ``report_config_verdict`` (one JSON line ``{"ok", "problems"}``, then wait for ``b"g"``).
* The launcher's side (:class:`VerdictsMixin`, part of the supervisor): collect every local child's
  and Ray replica's verdict within the start-up bound; if any config is invalid, raise one
  ``ConfigError`` listing every problem with the file:line of its key and "did you mean", and let
  nothing serve; else tell every child to go. A child that exits or stays silent past the bound is a
  :class:`~nemo_gym.run.supervision.children.StartupError` naming it with its last log lines.
"""

from __future__ import annotations

import json
import os
import selectors
import time
from typing import Any

from nemo_gym.config.instances import ServerInstance
from nemo_gym.config.problems import ConfigError
from nemo_gym.run.supervision.children import ChildServer, StartupError


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
