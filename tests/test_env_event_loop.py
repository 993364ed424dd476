"""No environment blocks its servers' event loops under load (issue 25): each environment that runs on the
scripted model without outside services runs ~150 rollouts, 8 in flight, through
:func:`nemo_gym.tools.loop_check.check_loop_lag`, which fails naming any server whose loop ticked more
than 100 ms late for more than 10% of its ticks (and more than once). Speeds are not asserted.

Throughput at 64 in flight, as a ratio of the bare-hop limit, is ``ng_bench``'s job (see
docs/observability.md, "Event-loop lag"); this test catches a handler that blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.tools.loop_check import check_loop_lag, drive_rollouts
from nemo_gym.tools.testing import example_rows, running_servers

NUM_ROLLOUTS = 150
SPLIT_ACROSS_WORKERS = True  # each test starts its own servers: any worker may run it (docs/testing.md)
CONCURRENCY = 8

# The scripted policy model also answers the judge's prompts, with a verdict (no outside judge).
JUDGE_SCRIPT = {
    "policy_model": {
        "responses_api_models": {
            "scripted_model": {
                "scripts_by_input": [
                    {"contains": "You are grading a short answer", "turns": [{"text": "Same. [[A=B]]"}]}
                ]
            }
        }
    }
}
# instruction_following imports NLTK (and SciPy through it) on a background thread after start-up,
# which takes seconds of GIL time. A check that needs NLTK waits for that import, so this row's
# rollout lets the load start once the server is warm.
NLTK_ROW = {
    "instruction_id_list": ["length_constraints:number_sentences"],
    "kwargs": [{"num_sentences": 1, "relation": "at least"}],
    "prompt": "Say hello.",
    "responses_create_params": {"input": [{"role": "user", "content": "Say hello."}]},
}


@dataclass
class Env:
    folder: str
    config: str | None = None  # default: configs/<folder>.yaml
    agent: str | None = None  # default: <folder>_simple_agent
    rows_file: str | None = None  # default: data/example.jsonl
    extra: dict[str, Any] = field(default_factory=dict)
    warm_rows: list[dict[str, Any]] = field(default_factory=list)
    num_rollouts: int = NUM_ROLLOUTS

    def config_path(self) -> str:
        return f"resources_servers/{self.folder}/configs/{self.config or self.folder + '.yaml'}"

    def rows(self) -> list[dict[str, Any]]:
        if self.rows_file is None:
            return example_rows(self.folder)
        path = PACKAGE_PARENT_DIR / "resources_servers" / self.folder / "data" / self.rows_file
        return [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


ENVS = {
    "example_single_tool_call": Env("example_single_tool_call"),
    "example_multi_step": Env("example_multi_step"),
    "example_session_state_mgmt": Env("example_session_state_mgmt"),
    "calendar": Env("calendar"),
    "equivalence_llm_judge": Env("equivalence_llm_judge", extra=JUDGE_SCRIPT),
    "instruction_following": Env("instruction_following", warm_rows=[NLTK_ROW]),
    "math_with_judge": Env("math_with_judge"),
    "mcqa": Env("mcqa"),
    "reasoning_gym": Env("reasoning_gym"),
    "single_step_tool_use_with_argument_comparison": Env("single_step_tool_use_with_argument_comparison"),
    "structured_outputs": Env("structured_outputs"),
    "workplace_assistant": Env("workplace_assistant"),
    "xlam_fc": Env("xlam_fc"),
    "law_discovery": Env("law_discovery"),
    "chemistry": Env("chemistry"),
    "literature_qa": Env("literature_qa"),
    # Its own agent (one model turn per step); on the default scripted turn (no code) no sandbox run.
    "scientific_code": Env("scientific_code", agent="scientific_code_agent"),
    # A Jupyter kernel per rollout (a second or two to start, in bubblewrap): few rollouts, marked slow.
    "data_analysis_capsules": Env(
        "data_analysis_capsules", agent="data_analysis_capsules_agent", num_rollouts=10
    ),
    "aviary_gsm8k": Env("aviary", "gsm8k_aviary.yaml", "gsm8k_aviary_agent", "gsm8k_example.jsonl"),
    "aviary_hotpotqa": Env(
        "aviary", "hotpotqa_aviary.yaml", "hotpotqa_aviary_agent", "hotpotqa_example.jsonl"
    ),
    # The sandboxed ones run programs in bubblewrap (tens of ms each): fewer rollouts, marked slow.
    "code_gen": Env("code_gen", num_rollouts=60),
    "math_with_code": Env("math_with_code", num_rollouts=40),
    # A sandbox session per rollout, started and forked (~15 s for 40).
    "workspace_tasks": Env("workspace_tasks", num_rollouts=40),
    # 30 model turns per episode on the scripted model (it never reaches a goal).
    "gymnasium": Env("gymnasium", agent="gymnasium_agent", num_rollouts=24),
}
# Slow to start (Aviary imports LiteLLM) or to run; GSM8K stands for Aviary in the quick set.
SLOW = {"code_gen", "math_with_code", "gymnasium", "aviary_hotpotqa", "data_analysis_capsules"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in ENVS])
def test_environment_does_not_block_its_event_loop(name: str) -> None:
    env = ENVS[name]
    agent = env.agent or f"{env.folder}_simple_agent"
    with running_servers([env.config_path()], env.extra) as helper:
        if env.warm_rows:
            drive_rollouts(helper, agent, env.warm_rows, len(env.warm_rows), 1)
        summaries = check_loop_lag(
            helper, agent, env.rows(), num_rollouts=env.num_rollouts, concurrency=CONCURRENCY
        )
    assert summaries and all(s.ticks > 0 for s in summaries.values()), summaries
