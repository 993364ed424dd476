"""nemo_gym.sandbox.rollouts: one sandbox session per rollout, started lazily, bounded, always closed.

Real sandbox sessions (bubblewrap and overlayfs: root, as CI runs).
"""

from __future__ import annotations

import asyncio

from nemo_gym.sandbox import SandboxSession
from nemo_gym.sandbox.rollouts import RolloutSandboxes

LIMITS = {"command_wall_time_s": 10, "command_cpu_time_s": 10, "memory_mib": 256, "processes": 64}


async def _start() -> SandboxSession:
    return await SandboxSession.start(limits=LIMITS)


async def test_lazily_started_replaced_when_closed_evicted_past_the_bound_and_closed_at_the_end() -> None:
    rollouts = RolloutSandboxes(max_sessions=2)
    first = rollouts.put("a", "task-a")
    assert first.sandbox is None and not first.live and first.data == "task-a"  # nothing started yet
    sandbox, restarted = await first.ensure(_start)
    assert not restarted and (await sandbox.exec("echo hi > f; cat f")).stdout == "hi\n"
    assert await first.ensure(_start) == (sandbox, False)  # the same one while it lives

    await sandbox.close("its idle timeout, say")
    again, restarted = await first.ensure(_start)  # closed on its own: a new one, and the caller is told
    assert restarted and again is not sandbox and first.restarts == 1
    assert (await again.exec("ls")).stdout == ""

    second = rollouts.put("b", "task-b")
    await second.ensure(_start)
    assert rollouts.get("a") is first  # "a" is now the most recently used: "b" goes first
    rollouts.put("c", "task-c")
    assert len(rollouts) == 2 and rollouts.get("b") is None
    for _ in range(100):  # the evicted rollout's sandbox is closed in the background
        if second.sandbox is None:
            break
        await asyncio.sleep(0.05)
    assert second.sandbox is None

    popped = rollouts.pop("a")
    assert popped is first and rollouts.get("a") is None and first.live  # the caller closes what it pops
    await first.close("verified")
    assert again.closed == "verified" and first.sandbox is None

    third = rollouts.get("c")
    assert third is not None
    live, _ = await third.ensure(_start)
    await rollouts.close_all()
    assert live.closed is not None and len(rollouts) == 0
