"""The files ``ng_init_resources_server`` writes, as functions of the environment name."""

from __future__ import annotations

import json

WORDS = ("banana", "strawberry", "kiwi", "pineapple", "fig")

APP = '''"""{name}: one tool (``count_letters``) and a verifier.

Reward 1.0 when the final assistant text contains the row's ``expected_answer`` as a whole word, else 0.0.
Replace the tool and the verifier with your environment's own.
"""

from __future__ import annotations

import re

from fastapi import FastAPI
from pydantic import BaseModel

from nemo_gym.server.resources import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class {title}ResourcesServerConfig(BaseResourcesServerConfig):
    pass


class CountLettersRequest(BaseModel):
    word: str


class CountLettersResponse(BaseModel):
    word: str
    count: int


class {title}VerifyRequest(BaseVerifyRequest):
    expected_answer: str


class {title}ResourcesServer(SimpleResourcesServer):
    config: {title}ResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/count_letters")(self.count_letters)  # one POST /<tool_name> per tool
        return app

    async def count_letters(self, body: CountLettersRequest) -> CountLettersResponse:
        return CountLettersResponse(word=body.word, count=sum(c.isalpha() for c in body.word))

    async def verify(self, body: {title}VerifyRequest) -> BaseVerifyResponse:
        text = body.response.output_text
        found = re.search(rf"\\b{{re.escape(body.expected_answer.strip())}}\\b", text) is not None
        return BaseVerifyResponse.from_request(body, reward=1.0 if found else 0.0)


if __name__ == "__main__":
    {title}ResourcesServer.run_webserver()
'''

CONFIG = """# The environment: one tool (count_letters) and a verifier.
{name}:
  resources_servers:
    {name}:
      entrypoint: app.py
      domain: other
      verified: false
      description: Count the letters of a word with the count_letters tool, then answer.

# The agent that runs it against the model instance `policy_model` (defined by a model config).
{name}_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server:
        type: resources_servers
        name: {name}
      model_server:
        type: responses_api_models
        name: policy_model
      max_steps: 5
      datasets:
      - name: example
        type: example
        jsonl_fpath: resources_servers/{name}/data/example.jsonl
"""

TEST = '''"""{name} against real servers on 127.0.0.1, with the scripted model as the policy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import post_json, run_rollout, running_servers, server_url

FOLDER = Path(__file__).resolve().parents[1]
ROOT = FOLDER.parents[1]  # the folder that holds resources_servers/
CONFIG = str(FOLDER / "configs" / "{name}.yaml")
AGENT = "{name}_simple_agent"
ROWS = [orjson.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines()]


def _script() -> list[dict]:
    """For each example row: call count_letters with the row's word, then answer with the count."""
    return [
        {{
            "contains": f"'{{row['word']}}'",
            "turns": [
                {{"tool_calls": [{{"name": "count_letters", "arguments": {{"word": row["word"]}}}}]}},
                {{"text": f"The word has {{row['expected_answer']}} letters."}},
            ],
        }}
        for row in ROWS
    ]


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    cwd = os.getcwd()
    os.chdir(ROOT)  # server folders are found relative to the working directory
    try:
        extra = {{
            "policy_model": {{"responses_api_models": {{"scripted_model": {{"scripts_by_input": _script()}}}}}}
        }}
        with running_servers([CONFIG], extra) as h:
            yield h
    finally:
        os.chdir(cwd)


def test_tool_over_http(helper: RunHelper) -> None:
    resp = post_json(server_url(helper, "{name}") + "/count_letters", {{"word": "kiwi"}})
    assert resp.status_code == 200 and resp.json() == {{"word": "kiwi", "count": 4}}


def test_every_example_row_is_solved(helper: RunHelper) -> None:
    assert len(ROWS) == 5
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, result["response"]["output"]
        assert result["word"] == row["word"]  # task fields reach the verifier and the output


def test_wrong_answer_scores_zero(helper: RunHelper) -> None:
    row = ROWS[0]
    response = {{
        "id": "resp_1",
        "created_at": 0.0,
        "model": "m",
        "object": "response",
        "output": [
            {{
                "type": "message",
                "id": "m1",
                "role": "assistant",
                "status": "completed",
                "content": [{{"type": "output_text", "text": "It has 99 letters.", "annotations": []}}],
            }}
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }}
    resp = post_json(server_url(helper, "{name}") + "/verify", {{**row, "response": response}})
    assert resp.status_code == 200 and resp.json()["reward"] == 0.0
'''

README = """# {name}

**What it does.** The model is asked how many letters a word has; it should call the
`count_letters` tool and answer with the number. (Scaffolded by `ng_init_resources_server`:
replace the tool, the data and the verifier with your environment's own.)

**Tools.** `POST /count_letters {{"word": str}}` -> `{{"word": str, "count": int}}`.

**Reward.** 1.0 when the final assistant text contains the row's `expected_answer` as a whole word,
else 0.0. Task fields: `word`, `expected_answer`.

**Data.** `data/example.jsonl`: 5 example rows. Train/validation data: add datasets to
`configs/{name}.yaml` (`datasets: [{{name, type, jsonl_fpath, license}}]`) and run `ng_prepare_data`.

**Licensing.** Code: Apache 2.0. Example data: written for this scaffold, Apache 2.0.

**Dependencies.** None beyond nemo-gym (`requirements.txt`).

## How to run

```bash
ng_test +entrypoint=resources_servers/{name}
ng_run "+config_paths=[resources_servers/{name}/configs/{name}.yaml,responses_api_models/scripted_model/configs/scripted_model.yaml]"
ng_collect_rollouts +agent_name={name}_simple_agent +input_jsonl_fpath=resources_servers/{name}/data/example.jsonl +output_jsonl_fpath=results/{name}.jsonl
```
"""

GITIGNORE = "*train.jsonl\n*validation.jsonl\n*train_prepare.jsonl\n*validation_prepare.jsonl\n*example_prepare.jsonl\n"


def title_of(name: str) -> str:
    """``my_env`` -> ``MyEnv`` (upstream's class-name rule)."""
    return "".join(part.capitalize() for part in name.split("_"))


def example_rows() -> list[dict]:
    rows = []
    for word in WORDS:
        prompt = f"How many letters are in the word '{word}'? Use the count_letters tool, then answer with the number."
        rows.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": prompt}],
                    "tools": [
                        {
                            "type": "function",
                            "name": "count_letters",
                            "description": "Count the letters of a word.",
                            "parameters": {
                                "type": "object",
                                "properties": {"word": {"type": "string", "description": "The word."}},
                                "required": ["word"],
                                "additionalProperties": False,
                            },
                            "strict": True,
                        }
                    ],
                },
                "word": word,
                "expected_answer": str(len(word)),
            }
        )
    return rows


def render_files(name: str) -> dict[str, str]:
    """Relative path -> content of every file of a new environment ``name``."""
    fields = {"name": name, "title": title_of(name)}
    return {
        "app.py": APP.format(**fields),
        f"configs/{name}.yaml": CONFIG.format(**fields),
        "data/example.jsonl": "".join(json.dumps(r) + "\n" for r in example_rows()),
        "data/.gitignore": GITIGNORE,
        "tests/test_app.py": TEST.format(**fields),
        "requirements.txt": "-e nemo-gym[dev] @ ../../\n",
        "README.md": README.format(**fields),
    }


PYPROJECT = """[build-system]
requires = ["setuptools>=62.3"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A NeMo Gym environment: {name}."
requires-python = ">=3.10"
# nemo-gym itself is not listed: the environment runs on the nemo-gym you launch it with (a copy from
# a package index could shadow it). Add the environment's own dependencies here and in
# {name}/resources_servers/{name}/requirements.txt (what ng_list and ng_run check).
dependencies = []

# How nemo-gym finds the server: the dotted path of its folder inside the package.
[project.entry-points."nemo_gym.servers"]
{name} = "{name}.resources_servers.{name}"

[tool.setuptools]
packages = ["{name}"]

# The server folder is package data: app.py, configs/, data/, tests/, README.md, requirements.txt.
[tool.setuptools.package-data]
{name} = ["resources_servers/{name}/*", "resources_servers/{name}/**/*"]

[tool.setuptools.exclude-package-data]
{name} = ["**/__pycache__/*", "**/*.pyc"]
"""

PACKAGE_README = """# {name}

A NeMo Gym environment as a pip package. The server folder is
`{name}/resources_servers/{name}/` (see its README.md); `pyproject.toml` declares it in the entry point
group `nemo_gym.servers`, so once installed nemo-gym finds it like a folder of its own:

```bash
pip install .                      # or: pip install -e . while you work on it
ng_list +kind=resources_servers    # shows {name}, from package {dist}
ng_run +env={name} "+config_paths=[responses_api_models/scripted_model/configs/scripted_model.yaml]"
ng_test +entrypoint={name}/resources_servers/{name}   # from this directory
```
"""

PACKAGE_INIT = '''"""{name}: a NeMo Gym environment; the server is the folder resources_servers/{name}/ next to this file."""
'''


def render_package_files(name: str) -> dict[str, str]:
    """Relative path -> content of every file of an installable package holding environment ``name``."""
    fields = {"name": name, "dist": name.replace("_", "-")}
    files = {
        "pyproject.toml": PYPROJECT.format(**fields),
        "README.md": PACKAGE_README.format(**fields),
        f"{name}/__init__.py": PACKAGE_INIT.format(**fields),
    }
    server = render_files(name)
    server["requirements.txt"] = "nemo-gym\n"  # satisfied by the running nemo-gym, never installed
    files.update({f"{name}/resources_servers/{name}/{rel}": text for rel, text in server.items()})
    return files
