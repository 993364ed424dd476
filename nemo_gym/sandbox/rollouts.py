"""One :class:`~nemo_gym.sandbox.session.SandboxSession` per rollout session, for a resources server whose
tools work in a sandbox that lives as long as the rollout.

Contract
--------
* :class:`RolloutSandboxes` maps a rollout's session id (``nemo_gym.server.base.get_session_id``) to a
  :class:`RolloutSandbox`: a lock (one tool call at a time per rollout, so a read-modify-write is
  atomic), the sandbox (None until the first tool call starts it: :meth:`RolloutSandbox.ensure`), and
  whatever the server keeps per rollout (``data``, e.g. the task row ``/seed_session`` got).
* At most ``max_sessions`` rollouts are remembered: past it the least recently used is dropped and its
  sandbox closed in the background (a forgotten rollout never pins a sandbox). Live sandboxes are also
  bounded by ``SessionLimits.max_sessions`` (a start past it queues, then ``SandboxBusyError``: 503).
* :meth:`RolloutSandboxes.pop` takes a rollout out (at ``/verify`` or ``/end_session``; the caller
  closes or uses its sandbox); :meth:`RolloutSandboxes.close_all` closes every sandbox (server shutdown:
  nothing outlives the server). A sandbox closed on its own (idle timeout, lifetime, dying) shows as
  ``sandbox.closed`` not None; :meth:`RolloutSandbox.ensure` then starts a new one.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_gym.sandbox.session import SandboxSession


@dataclass
class RolloutSandbox:
    """One rollout's sandbox and state (see the module docstring)."""

    data: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: SandboxSession | None = None
    restarts: int = 0  # sandboxes started after the first (the previous one closed on its own)

    @property
    def live(self) -> bool:
        return self.sandbox is not None and self.sandbox.closed is None

    async def ensure(self, start: Callable[[], Awaitable[SandboxSession]]) -> tuple[SandboxSession, bool]:
        """The live sandbox, started by ``start()`` when there is none; True when this call started it
        after an earlier one had closed (the caller tells the model its workspace was reset)."""
        if self.live:
            assert self.sandbox is not None
            return self.sandbox, False
        restarted = self.sandbox is not None
        self.sandbox = await start()
        self.restarts += int(restarted)
        return self.sandbox, restarted

    async def close(self, reason: str) -> None:
        """Close the sandbox (idempotent)."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.close(reason)


class RolloutSandboxes:
    """The rollouts of one server process (see the module docstring)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, RolloutSandbox] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> RolloutSandbox | None:
        """The rollout's entry (marked most recently used), or None."""
        entry = self._entries.get(session_id)
        if entry is not None:
            self._entries.move_to_end(session_id)
        return entry

    def put(self, session_id: str, data: Any) -> RolloutSandbox:
        """A new entry for the rollout (an older one of the same id is dropped and its sandbox closed)."""
        old = self._entries.pop(session_id, None)
        if old is not None:
            self._close_later(old, "its rollout session was seeded again")
        entry = self._entries[session_id] = RolloutSandbox(data=data)
        while len(self._entries) > self.max_sessions:
            _, evicted = self._entries.popitem(last=False)
            self._close_later(evicted, "more rollouts than max_sessions: the least recently used was dropped")
        return entry

    def pop(self, session_id: str) -> RolloutSandbox | None:
        return self._entries.pop(session_id, None)

    def _close_later(self, entry: RolloutSandbox, reason: str) -> None:
        if entry.sandbox is None:
            return
        task = asyncio.get_running_loop().create_task(entry.close(reason))
        self._closing.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._closing.discard)

    async def close_all(self, reason: str = "the server is shutting down") -> None:
        entries, self._entries = list(self._entries.values()), OrderedDict()
        await asyncio.gather(*(e.close(reason) for e in entries), *self._closing, return_exceptions=True)
