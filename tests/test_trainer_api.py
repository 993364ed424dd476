"""The Python API an RL trainer uses, played the way a trainer plays it.

Start the servers with ``RunHelper().start(GlobalConfigDictParserConfig(...))``, run task rows with
``RolloutCollectionHelper().run_examples(...)``, read each reward and the token ids / log-probs of
every model-produced output item, shut down, and check that no child process outlives the run.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.errors import UpstreamError
from nemo_gym.global_config import HEAD_SERVER_KEY_NAME, GlobalConfigDictParserConfig
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.run.supervision.spawning import kept_fork_server_pids
from nemo_gym.server_utils import BaseServerConfig, ServerClient
from nemo_gym.tools.testing import SCRIPTED_MODEL_CONFIG, example_rows
from resources_servers.example_single_tool_call.app import weather_report

ENV = "example_single_tool_call"
AGENT = f"{ENV}_simple_agent"
ASSISTANT_TAG = "<|assistant|>"


def test_trainer_names_are_importable() -> None:
    assert HEAD_SERVER_KEY_NAME == "head_server"
    assert BaseServerConfig(host="127.0.0.1", port=12345).base_url == "http://127.0.0.1:12345"
    parser = GlobalConfigDictParserConfig(initial_global_config_dict={"a": 1}, skip_load_from_cli=True)
    assert parser.initial_global_config_dict == {"a": 1} and parser.skip_load_from_cli is True
    client = ServerClient(
        global_config_dict={"x": {"responses_api_agents": {"simple_agent": {"host": "h", "port": 1}}}}
    )
    assert client.base_url("x") == "http://h:1"
    for name in ("post", "get", "load_from_global_config"):
        assert callable(getattr(ServerClient, name))


def _scripts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows 0-2: the model looks up the right city (reward 1); rows 3-4: a wrong one (reward 0)."""
    rules = []
    for i, row in enumerate(rows):
        city = row["expected_city"] if i < 3 else "Atlantis"
        turns = [
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]},
            {"text": weather_report(city)},
        ]
        rules.append({"contains": row["expected_city"], "turns": turns})
    return rules


def _model_produced(item: dict[str, Any]) -> bool:
    kind = item.get("type", "message")
    return kind in ("function_call", "reasoning") or (kind == "message" and item.get("role") == "assistant")


def _text(ids: list[int]) -> str:
    """The scripted model's token ids are UTF-8 bytes of a chat-template-like rendering."""
    assert all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    return bytes(ids).decode("utf-8")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children_of_this_process() -> set[int]:
    """This process's descendants, but the fork server it keeps between runs (it outlives them on purpose)."""
    return {p.pid for p in psutil.Process().children(recursive=True)} - kept_fork_server_pids()


async def test_trainer_collects_rewards_and_token_ids() -> None:
    rows = example_rows(ENV)
    before = _children_of_this_process()
    helper = RunHelper()
    server_pids: list[int] = []
    results: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        helper.start(
            GlobalConfigDictParserConfig(
                initial_global_config_dict={
                    "config_paths": [f"resources_servers/{ENV}/configs/{ENV}.yaml", SCRIPTED_MODEL_CONFIG],
                    HEAD_SERVER_KEY_NAME: {"host": "127.0.0.1", "port": 0},
                    "policy_model": {
                        "responses_api_models": {
                            "scripted_model": {
                                "return_token_id_information": True,
                                "scripts_by_input": _scripts(rows),
                            }
                        }
                    },
                },
                skip_load_from_cli=True,
            )
        )
        server_pids = [r["pid"] for r in helper.server_instances()]
        assert len(server_pids) == 3 and helper.head_server_config.port not in (0, 11000)

        collector = RolloutCollectionHelper(num_samples_in_parallel=4)
        examples = [
            {
                **row,
                "agent_ref": {"type": "responses_api_agents", "name": AGENT},
                "_ng_task_index": i,
                "_ng_rollout_index": r,
            }
            for i, row in enumerate(rows)
            for r in range(2)
        ]
        for future in collector.run_examples(examples, head_server_config=helper.head_server_config):
            row, result = await future
            results.append((row, result))
        # A row naming no agent is refused, not sent.
        with pytest.raises(ValueError, match="agent_ref"):
            for future in collector.run_examples([rows[0]], head_server_config=helper.head_server_config):
                await future
        # An infrastructure failure surfaces as an exception naming the server, never as a reward.
        broken = {**examples[0], "expected_city": None}
        with pytest.raises(UpstreamError) as failure:
            for future in collector.run_examples([broken], head_server_config=helper.head_server_config):
                await future
        assert failure.value.server == AGENT and failure.value.status == 502
        await collector.aclose()
    finally:
        helper.shutdown()

    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r, _ in results) == [
        (i, r) for i in range(5) for r in range(2)
    ]
    for row, result in results:
        task = row["_ng_task_index"]
        assert result["expected_city"] == row["expected_city"]
        assert result["reward"] == (1.0 if task < 3 else 0.0)
        assert result["agent_ref"]["name"] == AGENT
        items = [item for item in result["response"]["output"] if _model_produced(item)]
        assert [item["type"] for item in items] == ["function_call", "message"]
        prompts, generations = [], []
        for item in items:
            prompt_ids, gen_ids, log_probs = (
                item["prompt_token_ids"],
                item["generation_token_ids"],
                item["generation_log_probs"],
            )
            assert prompt_ids and gen_ids and len(log_probs) == len(gen_ids)
            assert log_probs == [-round(0.01 * (t % 97 + 1), 2) for t in gen_ids]
            prompts.append(_text(prompt_ids))
            generations.append(_text(gen_ids))
        call, message = items
        assert generations[0] == f"<|call|>get_weather({call['arguments']})<|end|>"
        assert generations[1] == f"{message['content'][0]['text']}<|end|>"
        # Turn 2's prompt extends turn 1's prompt and generation, token for token, then the tool result.
        assert prompts[0].endswith(ASSISTANT_TAG) and prompts[1].endswith(ASSISTANT_TAG)
        assert prompts[1].startswith(prompts[0] + generations[0] + "<|tool|>")
        assert row["expected_city"] in prompts[0]

    # Nothing of the run is left: the servers are gone and no new child process remains.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        leftover = _children_of_this_process() - before
        alive = [pid for pid in server_pids if _alive(pid)]
        if not leftover and not alive:
            break
        time.sleep(0.1)
    assert not leftover and not alive, f"left behind: children {leftover}, servers {alive}"
