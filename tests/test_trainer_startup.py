"""Trainer start-up as NeMo RL's environment wrapper does it, and the config surface it relies on.

The wrapper builds an initial config (config files, ``policy_*`` values, the head server on 0.0.0.0 and
a port it chose, client pool sizes), calls ``RunHelper().start(GlobalConfigDictParserConfig(
dotenv_path=..., initial_global_config_dict=..., skip_load_from_cli=True))``, then runs rows with
``RolloutCollectionHelper().run_examples(examples=..., head_server_config=...)`` and checks every
result's token ids for contiguity (each model turn's prompt starts with every token seen before in
the rollout) before it trains on them.
"""

from __future__ import annotations

import asyncio
import copy
import socket
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from nemo_gym import global_config as gc
from nemo_gym.cli import GlobalConfigDictParserConfig as CliParserConfig
from nemo_gym.cli import RunHelper
from nemo_gym.config import process as config_process
from nemo_gym.config.keys import DEFAULT_CONNECTION_LIMIT
from nemo_gym.config.validation import validate_global_config
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.errors import UpstreamError
from nemo_gym.global_config import (
    ConfigError,
    GlobalConfigDictParser,
    GlobalConfigDictParserConfig,
    get_first_server_config_dict,
)
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.server_utils import HEAD_SERVER_KEY_NAME
from nemo_gym.tools.testing import SCRIPTED_MODEL_CONFIG, example_rows
from resources_servers.example_single_tool_call.app import weather_report

ENV = "example_single_tool_call"
AGENT = f"{ENV}_simple_agent"
ENV_CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
LOCAL_MODEL_CONFIG = "responses_api_models/local_model/configs/local_model.yaml"
BOUND_S = 300.0  # outer bound on a whole batch of rollouts (never a speed check)


# ------------------------------------------------------------------------------------------------
# GlobalConfigDictParserConfig: upstream's fields, each honoured.


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_parser_config_takes_upstreams_fields_and_names_an_unknown_one() -> None:
    cfg = GlobalConfigDictParserConfig(
        dotenv_path=Path("/x/env.yaml"),
        initial_global_config_dict=DictConfig({"a": 1}),
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
        hide_secrets=True,
        offline=True,
    )
    assert cfg.dotenv_path == Path("/x/env.yaml") and cfg.skip_load_from_dotenv and cfg.hide_secrets
    assert cfg.initial_dict() == {"a": 1}
    # Our earlier name still works, as an alias of the same setting.
    assert GlobalConfigDictParserConfig(skip_load_from_env_yaml=True).skip_load_from_dotenv is True
    assert GlobalConfigDictParserConfig(skip_load_from_dotenv=True).skip_load_from_env_yaml is True
    with pytest.raises(ValueError, match="same setting"):
        GlobalConfigDictParserConfig(skip_load_from_env_yaml=True, skip_load_from_dotenv=False)
    # An unknown field is an error naming it (it used to be dropped without a word).
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['dotenv_pth'\]\. Did you mean 'dotenv_path'"):
        GlobalConfigDictParserConfig(dotenv_pth="/x/env.yaml")
    assert CliParserConfig is GlobalConfigDictParserConfig  # ``from nemo_gym.cli import ...`` as NeMo RL does
    assert set(GlobalConfigDictParserConfig.NO_MODEL_GLOBAL_CONFIG_DICT) >= {
        "policy_base_url",
        "policy_api_key",
    }


def test_dotenv_path_is_read_and_initial_values_beat_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "env.yaml", "from_cwd_env_yaml: 1\npolicy_api_key: cwd-key\n")
    dotenv = _write(
        tmp_path / "nemo_gym_env.yaml", "policy_api_key: dotenv-key\npolicy_model_name: dotenv-model\n"
    )
    conf = tmp_path / "extra.yaml"
    _write(conf, "policy_model_name: from-file\nother: ${policy_model_name}\n")

    parsed = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            dotenv_path=dotenv,
            initial_global_config_dict={"config_paths": [str(conf)], "policy_api_key": "dummy_key"},
            skip_load_from_cli=True,
        )
    )
    assert "from_cwd_env_yaml" not in parsed  # the named file replaces ./env.yaml
    assert parsed.policy_model_name == "dotenv-model"  # env file beats config files
    assert parsed.policy_api_key == "dummy_key"  # the initial dict beats the env file
    assert parsed.other == "dotenv-model"

    skipped = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            dotenv_path=dotenv,
            initial_global_config_dict={"config_paths": [str(conf)]},
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
        )
    )
    assert skipped.policy_model_name == "from-file" and "policy_api_key" not in skipped

    hidden = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(dotenv_path=dotenv, skip_load_from_cli=True, hide_secrets=True)
    )
    assert hidden.policy_api_key != "dotenv-key" and hidden.policy_model_name == "dotenv-model"

    # cli_args are applied over everything; skip_load_from_cli ignores sys.argv.
    monkeypatch.setattr("sys.argv", ["trainer.py", "++policy_model_name=from-argv"])
    from_argv = GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(dotenv_path=dotenv))
    assert from_argv.policy_model_name == "from-argv"
    not_argv = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(dotenv_path=dotenv, skip_load_from_cli=True)
    )
    assert not_argv.policy_model_name == "dotenv-model"


def test_a_missing_dotenv_path_loads_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "env.yaml", "from_cwd_env_yaml: 1\n")
    missing = tmp_path / "nemo_gym_env.yaml"
    parsed = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            dotenv_path=missing, initial_global_config_dict={"a": 1}, skip_load_from_cli=True
        )
    )
    assert dict(parsed) == {"a": 1}
    assert f"dotenv_path {missing} does not exist" in capsys.readouterr().err


def test_global_config_names_upstream_code_imports() -> None:
    assert (gc.TASK_INDEX_KEY_NAME, gc.ROLLOUT_INDEX_KEY_NAME) == ("_ng_task_index", "_ng_rollout_index")
    assert (gc.ATTEMPT_INDEX_KEY_NAME, gc.ROLLOUT_ID_KEY_NAME) == ("_ng_attempt_index", "_ng_rollout_id")
    assert (gc.AGENT_REF_KEY_NAME, gc.SKILLS_REF_KEY_NAME) == ("agent_ref", "skills_ref")
    assert (gc.RESPONSES_CREATE_PARAMS_KEY_NAME, gc.RESPONSE_KEY_NAME) == (
        "responses_create_params",
        "response",
    )
    assert (gc.HF_TOKEN_KEY_NAME, gc.DISALLOWED_PORTS_KEY_NAME) == ("hf_token", "disallowed_ports")
    assert (gc.CACHE_DIR_KEY_NAME, gc.RESULTS_DIR_KEY_NAME) == ("cache_dir", "results_dir")
    assert gc.POLICY_BASE_URL_KEY_NAME == "policy_base_url" and gc.DEFAULT_HEAD_SERVER_PORT == 11000

    cfg = OmegaConf.create(
        {
            "judge": {"responses_api_models": {"vllm_model": {"base_url": ["http://a/v1"], "model": "m"}}},
            "policy_base_url": "x",
        }
    )
    assert get_first_server_config_dict(cfg, "judge").model == "m"
    with pytest.raises(KeyError, match=r"No server instance named 'jugde'. Known instances: \['judge'\]"):
        get_first_server_config_dict(cfg, "jugde")
    port = gc.find_open_port(disallowed_ports=[11000])
    assert 0 < port < 65536 and port != 11000

    import nemo_gym

    assert nemo_gym.ROOT_DIR == Path(gc.__file__).parent and nemo_gym.PARENT_DIR == nemo_gym.ROOT_DIR.parent
    assert nemo_gym.CACHE_DIR == nemo_gym.WORKING_DIR / "cache"
    assert nemo_gym.RESULTS_DIR == nemo_gym.WORKING_DIR / "results"


def test_get_and_set_global_config_dict_take_a_parser_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc.NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME, raising=False)
    monkeypatch.setattr(config_process, "_GLOBAL_CONFIG", None)
    parser_config = GlobalConfigDictParserConfig(
        initial_global_config_dict={"x": 5}, skip_load_from_cli=True, skip_load_from_dotenv=True
    )
    assert gc.maybe_get_global_config_dict() is None
    assert gc.get_global_config_dict(parser_config).x == 5
    assert gc.maybe_get_global_config_dict().x == 5  # kept for later calls
    gc.set_global_config_dict(
        GlobalConfigDictParserConfig(
            initial_global_config_dict={"y": 6}, skip_load_from_cli=True, skip_load_from_dotenv=True
        )
    )
    assert dict(gc.get_global_config_dict()) == {"y": 6}
    gc.set_global_config_dict(None)
    assert gc.maybe_get_global_config_dict() is None


def test_trainer_keys_pass_the_option_check_and_their_typos_do_not(tmp_path: Path) -> None:
    def problems(initial: dict[str, Any]) -> str:
        loaded = GlobalConfigDictParserConfig(
            initial_global_config_dict=initial, skip_load_from_cli=True, skip_load_from_dotenv=True
        ).load(cwd=tmp_path)
        try:
            validate_global_config(loaded)
        except ConfigError as e:
            return str(e)
        return ""

    trainer_keys = {
        "global_aiohttp_connector_limit": 65536,
        "global_aiohttp_connector_limit_per_host": 16384,
        "default_host": "127.0.0.1",
        "policy_base_url": ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"],
        "policy_api_key": "dummy_key",
        "policy_model_name": "m",
        HEAD_SERVER_KEY_NAME: {"host": "0.0.0.0", "port": 5123},
    }
    assert problems(trainer_keys) == ""
    typo = problems({**trainer_keys, "global_aiohttp_connector_limt": 5})
    assert (
        "'global_aiohttp_connector_limt'" in typo and "Did you mean 'global_aiohttp_connector_limit'" in typo
    )
    bad = problems({**trainer_keys, "global_aiohttp_connector_limit_per_host": 0})
    assert "'global_aiohttp_connector_limit_per_host'" in bad and "must be a positive integer" in bad
    upstream_only = {
        "uv_cache_dir": "/c",
        "uv_venv_dir": "/v",
        "ray_head_node_address": "h:1",
        "dry_run": False,
    }
    assert problems({**trainer_keys, **upstream_only, "port_range_low": 5000, "port_range_high": 5999}) == ""
    assert "Did you mean 'uv_cache_dir'" in problems({**trainer_keys, "uv_cach_dir": "/c"})
    backwards = problems({**trainer_keys, "port_range_low": 6000, "port_range_high": 5000})
    assert "'port_range_low'" in backwards and "must be below port_range_high" in backwards


def test_pool_limits_come_from_the_trainer_keys() -> None:
    cfg = {"global_aiohttp_connector_limit": 64, "global_aiohttp_connector_limit_per_host": 8}
    assert config_process.client_connection_limits(cfg) == (64, 8)
    assert config_process.client_connection_limits({}) == (DEFAULT_CONNECTION_LIMIT, None)
    with pytest.raises(ValueError, match="global_aiohttp_connector_limit must be a positive integer"):
        config_process.client_connection_limits({"global_aiohttp_connector_limit": "many"})


# ------------------------------------------------------------------------------------------------
# The NeMo RL start-up, end to end.


def contiguity_check(result: dict[str, Any]) -> int:
    """NeMo RL's check over one result; returns the number of trainable (model-produced) items.

    Walking the output in order, an item is trainable when it has generation tokens; every trainable
    item's ``prompt_token_ids`` must start with all tokens seen so far (earlier prompts and
    generations), and then the seen tokens become its prompt plus its generation.
    """
    seen: list[int] = []
    trainable = 0
    for i, item in enumerate(result["response"]["output"]):
        generation = item.get("generation_token_ids")
        if not generation:
            continue
        prompt = item["prompt_token_ids"]
        assert prompt[: len(seen)] == seen, (
            f"Non-contiguous messages found at output item {i} ({item.get('type')}): its prompt does not start "
            f"with the {len(seen)} tokens seen earlier in the rollout"
        )
        assert len(item["generation_log_probs"]) == len(generation)
        seen = list(prompt) + list(generation)
        trainable += 1
    if not trainable:
        raise ValueError("NeMo Gym returned a result with no generation data")
    return trainable


PORT_RANGE = (23000, 23400)  # NeMo RL passes port_range_low/high and picks the head port inside it


def _free_port_in_range() -> int:
    for port in range(*PORT_RANGE):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def _nemo_rl_initial_config(
    model_config: str, model_block: dict[str, Any], default_host: str = "127.0.0.1"
) -> dict[str, Any]:
    """What NeMo RL's wrapper puts in ``initial_global_config_dict`` (ours: a local model instead of vLLM)."""
    return {
        "config_paths": [ENV_CONFIG, model_config],
        "policy_model": {"responses_api_models": model_block},
        "policy_model_name": "trained-policy",
        "policy_api_key": "dummy_key",
        "policy_base_url": ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"],  # one per DP rank
        "default_host": default_host,
        "global_aiohttp_connector_limit_per_host": 16384,
        "global_aiohttp_connector_limit": 65536,
        HEAD_SERVER_KEY_NAME: {"host": "0.0.0.0", "port": _free_port_in_range()},
        "port_range_low": PORT_RANGE[0],
        "port_range_high": PORT_RANGE[1],
        # Keys NeMo RL also sets that mean nothing here: accepted (and named once on stderr).
        "uv_cache_dir": "/tmp/uv_cache",
        "uv_venv_dir": "/tmp/uv_venvs",
        # NeMo RL also sets ray_head_node_address to its cluster: that joins it (tests/test_ray.py).
        "is_trajectory_collection": False,
    }


async def _nemo_rl_rollouts(
    tmp_path: Path,
    model_config: str,
    model_block: dict[str, Any],
    rows: list[dict[str, Any]],
    default_host: str = "127.0.0.1",
    agent_block: dict[str, Any] | None = None,
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]], RunHelper]:
    dotenv = _write(tmp_path / "nemo_gym_env.yaml", "policy_api_key: from-dotenv\nrun_label: from-dotenv\n")
    initial = _nemo_rl_initial_config(model_config, model_block, default_host)
    if agent_block is not None:
        initial[AGENT] = {"responses_api_agents": agent_block}
    head_port = initial[HEAD_SERVER_KEY_NAME]["port"]
    helper = RunHelper()
    helper.start(
        global_config_dict_parser_config=GlobalConfigDictParserConfig(
            dotenv_path=dotenv, initial_global_config_dict=DictConfig(initial), skip_load_from_cli=True
        )
    )
    try:
        helper.poll()
        cfg = helper.global_config_dict
        assert cfg.run_label == "from-dotenv" and cfg.policy_api_key == "dummy_key"
        assert list(cfg.policy_base_url) == initial["policy_base_url"]
        assert helper.head_server_config.host == "0.0.0.0" and helper.head_server_config.port == head_port
        assert {s["host"] for s in helper.server_instances()} == {default_host}  # servers without a host
        assert all(PORT_RANGE[0] <= s["port"] < PORT_RANGE[1] for s in helper.server_instances())

        examples = [
            {**copy.deepcopy(row), "agent_ref": {"type": "responses_api_agents", "name": AGENT}, "_rowidx": i}
            for i, row in enumerate(rows)
        ]
        sent = copy.deepcopy(examples)
        head_server_config = BaseServerConfig(host="127.0.0.1", port=head_port)  # the node IP, for NeMo RL
        rch = RolloutCollectionHelper()
        results = []
        for task in rch.run_examples(
            examples=examples, head_server_config=head_server_config, semaphore=asyncio.Semaphore(2)
        ):
            row, result = await asyncio.wait_for(task, BOUND_S)
            results.append((row, result))
        # A failing rollout raises with the HTTP status and the raw body, as NeMo RL reads them.
        # (One short model turn, whatever the row asked for: the error is the verifier's, not the model's.)
        broken = {**copy.deepcopy(examples[0]), "expected_city": None}
        broken["responses_create_params"] |= {"tool_choice": "none", "max_output_tokens": 16}
        with pytest.raises(UpstreamError) as failure:
            for task in rch.run_examples(examples=[broken], head_server_config=head_server_config):
                await asyncio.wait_for(task, BOUND_S)
        assert failure.value.status == 502 and b'"error"' in failure.value.response_content
        await rch.aclose()
        assert examples == sent  # nothing was added to the rows passed in
        return results, examples, helper
    except BaseException:
        helper.shutdown()
        raise


def _check_nemo_rl_results(
    results: list[tuple[dict[str, Any], dict[str, Any]]], examples: list[dict[str, Any]], min_turns: int
) -> None:
    assert sorted(r["_rowidx"] for r, _ in results) == list(range(len(examples)))
    for row, result in results:
        assert any(row is example for example in examples)  # the very dict passed in
        assert result["agent_ref"]["name"] == AGENT and result["_rowidx"] == row["_rowidx"]
        assert isinstance(result["reward"], float)
        assert contiguity_check(result) >= min_turns


def _scripted_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = example_rows(ENV)[:3]
    scripts = [
        {
            "contains": row["expected_city"],
            "turns": [
                {
                    "reasoning": "I should look it up.",
                    "tool_calls": [{"name": "get_weather", "arguments": {"city": row["expected_city"]}}],
                },
                {"text": weather_report(row["expected_city"])},
            ],
        }
        for row in rows
    ]
    return rows, scripts


def test_contiguity_check_catches_a_broken_prefix() -> None:
    good = {
        "response": {
            "output": [
                {
                    "type": "function_call",
                    "prompt_token_ids": [1, 2],
                    "generation_token_ids": [3],
                    "generation_log_probs": [-0.1],
                },
                {"type": "function_call_output"},
                {
                    "type": "message",
                    "prompt_token_ids": [1, 2, 3, 9],
                    "generation_token_ids": [4],
                    "generation_log_probs": [-0.2],
                },
            ]
        }
    }
    assert contiguity_check(good) == 2
    bad = copy.deepcopy(good)
    bad["response"]["output"][2]["prompt_token_ids"] = [1, 2, 7, 9]  # retokenised history
    with pytest.raises(AssertionError, match="Non-contiguous"):
        contiguity_check(bad)
    with pytest.raises(ValueError, match="no generation data"):
        contiguity_check({"response": {"output": [{"type": "message"}]}})


async def test_nemo_rl_startup_on_the_scripted_model(tmp_path: Path) -> None:
    rows, scripts = _scripted_rows()
    block = {"scripted_model": {"return_token_id_information": True, "scripts_by_input": scripts}}
    results, examples, helper = await _nemo_rl_rollouts(tmp_path, SCRIPTED_MODEL_CONFIG, block, rows)
    helper.shutdown()
    assert [r["reward"] for _, r in sorted(results, key=lambda x: x[0]["_rowidx"])] == [1.0, 1.0, 1.0]
    _check_nemo_rl_results(results, examples, min_turns=2)


async def test_nemo_rl_startup_on_the_scripted_model_runs_rows_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same start-up, checked for what does not depend on the scripted model's token ids."""
    rows, scripts = _scripted_rows()
    block = {"scripted_model": {"return_token_id_information": True, "scripts_by_input": scripts}}
    # Another loopback address as the node's, to see default_host used.
    results, examples, helper = await _nemo_rl_rollouts(
        tmp_path, SCRIPTED_MODEL_CONFIG, block, rows, "127.0.0.2"
    )
    helper.shutdown()
    assert sorted(r["_rowidx"] for r, _ in results) == [0, 1, 2]
    assert "no effect here, ignored: uv_cache_dir, uv_venv_dir" in capsys.readouterr().err
    for row, result in results:
        assert any(row is example for example in examples)
        assert result["reward"] == 1.0 and result["agent_ref"]["name"] == AGENT
        assert "_ng_task_index" not in row  # run_examples adds nothing to the row


async def test_nemo_rl_startup_on_local_model(tmp_path: Path) -> None:
    """A real LLM (CPU, llama.cpp): every model turn's prompt extends the rollout's earlier tokens."""
    rows = example_rows(ENV)[:2]
    for row in rows:
        row["responses_create_params"]["max_output_tokens"] = 96
        row["responses_create_params"]["temperature"] = 0.0
        # Every turn a forced (grammar-constrained) call: several model turns on any CPU, whatever the
        # model would choose; the agent stops at its max_steps (3: turns two and three extend turn one).
        row["responses_create_params"]["tool_choice"] = "required"
        row["responses_create_params"]["parallel_tool_calls"] = False
    block = {"local_model": {"return_token_id_information": True}}
    agent = {"simple_agent": {"max_steps": 3}}
    results, examples, helper = await _nemo_rl_rollouts(
        tmp_path, LOCAL_MODEL_CONFIG, block, rows, agent_block=agent
    )
    helper.shutdown()
    _check_nemo_rl_results(results, examples, min_turns=1)
    # Every rollout had several model turns (forced calls), so the check spanned turns.
    assert all(contiguity_check(result) >= 2 for _, result in results)


# ------------------------------------------------------------------------------------------------
# Client pool sizes from the trainer keys.


async def _max_concurrent_requests(client_cfg: dict[str, Any], n: int) -> int:
    """Send ``n`` requests at once through a ServerClient over ``client_cfg`` to a server that holds each
    one for a moment; return the most it ever had in progress at the same time."""
    from nemo_gym.client.server_client import close_shared_session
    from nemo_gym.server_utils import ServerClient

    state = {"active": 0, "max": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                state["active"] += 1
                state["max"] = max(state["max"], state["active"])
                await asyncio.sleep(0.05)
                state["active"] -= 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = {**client_cfg, "svc": {"resources_servers": {"x": {"host": "127.0.0.1", "port": port}}}}
    await close_shared_session()
    client = ServerClient(global_config_dict=cfg, auth_token="t")
    try:
        responses = await asyncio.wait_for(
            asyncio.gather(*(client.post("svc", "/r", json={}) for _ in range(n))), BOUND_S
        )
        assert all(r.status == 200 for r in responses)
    finally:
        await close_shared_session()
        server.close()
        await server.wait_closed()
    return state["max"]


async def test_connection_limit_per_host_bounds_requests_in_flight() -> None:
    assert await _max_concurrent_requests({"global_aiohttp_connector_limit_per_host": 2}, 12) == 2
    assert await _max_concurrent_requests({"global_aiohttp_connector_limit": 3}, 12) == 3
    assert await _max_concurrent_requests({}, 12) == 12  # defaults: 1024 in total, no per-host cap


def test_model_servers_aiohttp_connectors_follow_the_trainer_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from responses_api_models.vllm_model.app import VLLMModelConfig

    monkeypatch.setattr(
        config_process,
        "_GLOBAL_CONFIG",
        OmegaConf.create(
            {"global_aiohttp_connector_limit": 4096, "global_aiohttp_connector_limit_per_host": 512}
        ),
    )
    implicit = VLLMModelConfig(name="policy_model", base_url="http://127.0.0.1:1/v1", model="m")
    assert config_process.connector_limits(implicit) == (4096, 512)
    explicit = VLLMModelConfig(
        name="policy_model", base_url="http://127.0.0.1:1/v1", model="m", max_connections=8
    )
    assert config_process.connector_limits(explicit) == (8, 512)  # the server's own setting wins
    monkeypatch.setattr(config_process, "_GLOBAL_CONFIG", OmegaConf.create({}))
    assert config_process.connector_limits(implicit) == (DEFAULT_CONNECTION_LIMIT, 0)  # 0: no per-host cap


def test_the_training_vllm_config_nemo_rl_names_is_valid(tmp_path: Path) -> None:
    initial = {
        "config_paths": [ENV_CONFIG, "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"],
        "policy_base_url": ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"],
        "policy_api_key": "dummy_key",
        "policy_model_name": "m",
    }
    loaded = GlobalConfigDictParserConfig(
        initial_global_config_dict=initial, skip_load_from_cli=True, skip_load_from_dotenv=True
    ).load()
    validate_global_config(loaded)
    from responses_api_models.vllm_model.app import VLLMModelConfig

    block = OmegaConf.to_container(get_first_server_config_dict(loaded.config, "policy_model"), resolve=True)
    cfg = VLLMModelConfig.model_validate({**block, "name": "policy_model"})
    assert cfg.base_url == initial["policy_base_url"] and cfg.return_token_id_information is True
