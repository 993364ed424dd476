"""Env construction and reset() off the event loop (``RESET_OFF_LOOP``): where they run, and that an env
whose reset fails, times out or is abandoned is still closed. In-process, on the server class itself."""

from __future__ import annotations

import os

# Aviary imports LiteLLM, which fetches a price list over the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


import asyncio  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any, ClassVar  # noqa: E402

import pytest  # noqa: E402
from aviary.core import Environment, Message, TaskDataset, Tool  # noqa: E402

from resources_servers.aviary.app import AviaryResourcesServer  # noqa: E402
from resources_servers.aviary.gsm8k_app import GSM8kResourcesServer  # noqa: E402
from resources_servers.aviary.hotpotqa_app import HotPotQAResourcesServer  # noqa: E402
from resources_servers.aviary.notebook_app import NotebookResourcesServer  # noqa: E402
from resources_servers.aviary.schemas import AviaryResourcesServerConfig  # noqa: E402


class RecordingEnv(Environment[None]):
    """Records the thread of its construction, reset and close; ``reset_s`` of blocking work in reset."""

    def __init__(self, log: dict[str, Any], reset_s: float = 0.0, fail: bool = False) -> None:
        self.log, self.reset_s, self.fail = log, reset_s, fail
        log["made_on"] = threading.current_thread().name

    async def reset(self) -> tuple[list[Message], list[Tool]]:
        self.log["reset_on"] = threading.current_thread().name
        await asyncio.sleep(0)  # a coroutine that really awaits runs on the worker's own loop
        time.sleep(self.reset_s)
        if self.fail:
            raise RuntimeError("reset broke")
        self.log["reset_done"] = True
        return [Message(content="question")], []

    async def step(self, action: Any) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        self.log["closed_on"] = threading.current_thread().name

    def export_frame(self) -> Any:
        raise NotImplementedError


class RecordingDataset(TaskDataset[RecordingEnv]):
    def __init__(self, **env_kwargs: Any) -> None:
        self.env_kwargs = env_kwargs
        self.logs: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return 1

    def get_new_env_by_idx(self, idx: int) -> RecordingEnv:
        log: dict[str, Any] = {}
        self.logs.append(log)
        return RecordingEnv(log, **self.env_kwargs)


class OffLoopServer(AviaryResourcesServer[RecordingEnv, RecordingDataset]):
    RESET_OFF_LOOP: ClassVar[bool] = True


class OnLoopServer(AviaryResourcesServer[RecordingEnv, RecordingDataset]):
    pass


def _server(cls: type[AviaryResourcesServer], dataset: RecordingDataset, reset_timeout_s: float = 30) -> Any:
    config = AviaryResourcesServerConfig(
        name="aviary_test", host="127.0.0.1", port=0, entrypoint="app.py", reset_timeout_s=reset_timeout_s
    )
    return cls.model_construct(config=config, dataset=dataset)


async def _new_env_then_shutdown(server: Any) -> tuple[Any, str]:
    try:
        env, obs, tools = await server._new_env(0)
        return (env, obs, tools), threading.current_thread().name
    finally:
        await server.on_shutdown()


def test_the_shipped_servers_say_where_their_reset_runs() -> None:
    assert GSM8kResourcesServer.RESET_OFF_LOOP and HotPotQAResourcesServer.RESET_OFF_LOOP
    # The notebook's reset starts a Jupyter kernel whose client belongs to the server's loop.
    assert not NotebookResourcesServer.RESET_OFF_LOOP and not AviaryResourcesServer.RESET_OFF_LOOP


def test_construction_and_reset_run_on_the_worker_thread() -> None:
    dataset = RecordingDataset()
    (env, obs, tools), loop_thread = asyncio.run(_new_env_then_shutdown(_server(OffLoopServer, dataset)))
    log = dataset.logs[0]
    assert log["made_on"].startswith("aviary-reset") and log["reset_on"] == log["made_on"] != loop_thread
    assert log["reset_done"] and [m.content for m in obs] == ["question"] and tools == []
    assert "closed_on" not in log  # a live env stays open


def test_without_the_flag_they_run_on_the_loop() -> None:
    dataset = RecordingDataset()
    _, loop_thread = asyncio.run(_new_env_then_shutdown(_server(OnLoopServer, dataset)))
    assert dataset.logs[0]["made_on"] == dataset.logs[0]["reset_on"] == loop_thread


def test_a_failing_reset_closes_its_env_and_raises() -> None:
    dataset = RecordingDataset(fail=True)
    with pytest.raises(RuntimeError, match="reset broke"):
        asyncio.run(_new_env_then_shutdown(_server(OffLoopServer, dataset)))
    assert "closed_on" in dataset.logs[0] and "reset_done" not in dataset.logs[0]


def test_a_reset_past_its_timeout_fails_and_its_env_is_closed_when_it_ends() -> None:
    dataset = RecordingDataset(reset_s=0.5)

    async def run() -> float:
        server = _server(OffLoopServer, dataset, reset_timeout_s=0.1)
        t = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                await server._new_env(0)
            return time.monotonic() - t
        finally:
            await server.on_shutdown()  # waits for the worker, then the abandoned env's close runs
            for _ in range(100):
                if "closed_on" in dataset.logs[0]:
                    break
                await asyncio.sleep(0.01)

    waited = asyncio.run(run())
    # The loop was free while the reset blocked its thread: the timeout fired at its time.
    assert waited < 0.45, waited
    assert dataset.logs[0]["reset_done"] and "closed_on" in dataset.logs[0]


def test_offline_calculator_env_resets_like_aviarys_calculator_env() -> None:
    """The reused tools are the tools Aviary builds: same descriptions and schemas, each bound to its
    own env, and the episodes play the same."""
    from aviary.core import ToolCall, ToolRequestMessage
    from aviary.envs.gsm8k import CalculatorEnv

    from resources_servers.aviary.offline import OfflineCalculatorEnv, tool_of

    async def play(env: CalculatorEnv, answer: str) -> tuple[Any, ...]:
        obs, tools = await env.reset()
        action = ToolRequestMessage(tool_calls=[ToolCall.from_name("submit_answer", answer=answer)])
        step_obs, reward, done, truncated = await env.step(action)
        return (
            [m.model_dump() for m in obs],
            [t.model_dump(by_alias=True) for t in tools],
            sorted(vars(env)),
            [m.content for m in step_obs],
            reward,
            done,
            truncated,
        )

    async def run() -> None:
        for answer in ("42", "41", "forty-two"):
            ours = [OfflineCalculatorEnv(problem_id="p", problem="6 * 7?", answer=42) for _ in range(2)]
            theirs = CalculatorEnv(problem_id="p", problem="6 * 7?", answer=42)
            assert await play(ours[0], answer) == await play(theirs, answer), answer
            await ours[1].reset()
            # Each env's tools call its own methods; the schemas are copies, not shared objects.
            for a, b in zip(ours[0].tools, ours[1].tools, strict=True):
                assert a._tool_fn.__self__ is ours[0] and b._tool_fn.__self__ is ours[1]
                assert a.info == b.info and a.info is not b.info
        assert tool_of(ours[0].calculator).info == (await theirs.reset())[1][0].info

    asyncio.run(run())
