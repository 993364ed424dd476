"""ng_prepare_data: validation with file:line errors, agent_ref, prepared files and upstream-shaped metrics."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from nemo_gym.tools.data.prepare import main

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def row(text: str, tools: int = 0, temperature: float | None = None, **fields: object) -> dict:
    params: dict = {"input": [{"role": "user", "content": text}]}
    if tools:
        params["tools"] = [dict(TOOL, name=f"f{i}") for i in range(tools)]
    if temperature is not None:
        params["temperature"] = temperature
    return {"responses_create_params": params, **fields}


def write_jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else orjson.dumps(r).decode()) + "\n" for r in rows))


CONFIG = """\
my_env_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: my_env}
      model_server: {type: responses_api_models, name: policy_model}
      datasets:
      - name: train
        type: train
        jsonl_fpath: data/train.jsonl
        num_repeats: 2
        license: Apache 2.0
      - name: validation
        type: validation
        jsonl_fpath: data/validation.jsonl
      - name: example
        type: example
        jsonl_fpath: data/example.jsonl
"""


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "env.yaml").write_text("")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    write_jsonl(
        tmp_path / "data/train.jsonl",
        [row("a b", tools=1, temperature=0.5, level=1, tag="x"), row("c", tools=3, level=4, tag="y")],
    )
    write_jsonl(tmp_path / "data/validation.jsonl", [row("v", level=2, flags=[True, False])])
    write_jsonl(tmp_path / "data/example.jsonl", [row("e")] * 5)
    return tmp_path


def run(*args: str) -> int:
    try:
        main(["+config_paths=[cfg.yaml]", "+output_dirpath=out", *args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_train_preparation_writes_prepared_rows_and_metrics(root: Path) -> None:
    assert run("+mode=train_preparation") == 0
    train = [orjson.loads(x) for x in (root / "out/train.jsonl").read_text().splitlines()]
    assert len(train) == 4  # 2 rows x num_repeats 2
    ref = {"type": "responses_api_agents", "name": "my_env_simple_agent"}
    assert all(r["agent_ref"] == ref for r in train)
    assert [r["tag"] for r in train] == ["x", "x", "y", "y"]
    assert (root / "data/train_prepare.jsonl").read_text() == (root / "out/train.jsonl").read_text()
    assert len((root / "out/validation.jsonl").read_text().splitlines()) == 1
    assert not (root / "out/example.jsonl").exists()  # example is not in train_preparation's scope

    m = orjson.loads((root / "data/train_metrics.json").read_bytes())
    assert list(m)[:8] == [
        "name", "type", "jsonl_fpath", "num_repeats", "gitlab_identifier", "huggingface_identifier", "license",
        "Number of examples",
    ]  # fmt: skip
    assert m["license"] == "Apache 2.0" and m["num_repeats"] == 2 and m["Number of examples"] == 4
    assert m["Number of tools"] == {
        "Total # non-null values": 4, "Average": 2.0, "Min": 1.0, "Max": 3.0, "Standard deviation": 1.15,
    }  # fmt: skip
    assert m["Temperature"]["Total # non-null values"] == 2 and m["Temperature"]["Average"] == 0.5
    assert m["Number of turns"]["Average"] == 1.0
    assert m["level"] == {
        "Total # non-null values": 4, "Average": 2.5, "Min": 1.0, "Max": 4.0, "Standard deviation": 1.73,
    }  # fmt: skip
    assert m["tag"] == {"unique_count": 2, "total_count": 4}
    words = m["Json-dumped number of words (proxy for token count)"]
    assert words["Total # non-null values"] == 4 and words["Min"] < words["Max"]

    v = orjson.loads((root / "out/validation_metrics.json").read_bytes())
    assert "name" not in v and v["Number of examples"] == 1
    assert v["flags"]["Total # non-null values"] == 2 and v["flags"]["Average"] == 0.5
    assert v["Number of tools"] == {
        "Total # non-null values": 0, "Average": 0.0, "Min": 0.0, "Max": 0.0, "Standard deviation": 0.0,
    }  # fmt: skip


def test_example_validation_and_unchanged_metrics_are_not_rewritten(root: Path) -> None:
    assert run("+mode=example_validation") == 0
    metrics = root / "data/example_metrics.json"
    assert orjson.loads(metrics.read_bytes())["Number of examples"] == 5
    os.utime(metrics, (1, 1))
    assert run("+mode=example_validation") == 0
    assert metrics.stat().st_mtime == 1


def test_changed_metrics_conflict_keeps_old_file_until_overwrite(root: Path, capsys) -> None:
    assert run("+mode=example_validation") == 0
    metrics = root / "data/example_metrics.json"
    before = metrics.read_bytes()
    write_jsonl(root / "data/example.jsonl", [row("e")] * 4)
    assert run("+mode=example_validation") == 1
    assert metrics.read_bytes() == before
    conflict = root / "data/example_metrics_conflict.json"
    assert orjson.loads(conflict.read_bytes())["Number of examples"] == 4
    assert "example_metrics_conflict.json" in capsys.readouterr().err
    assert run("+mode=example_validation", "+overwrite_metrics_conflicts=true") == 0
    assert orjson.loads(metrics.read_bytes())["Number of examples"] == 4


def test_bad_rows_are_named_by_file_and_line_and_nothing_is_written(root: Path, capsys) -> None:
    write_jsonl(
        root / "data/train.jsonl",
        [
            row("ok"),
            "{not json",
            "",
            '["a list"]',
            {"responses_create_params": {"input": "x", "temprature": 1}},
        ],
    )
    assert run("+mode=train_preparation") == 2
    err = capsys.readouterr().err
    path = root / "data/train.jsonl"
    assert f"{path}:2: not valid JSON" in err
    assert f"{path}:4: expected a JSON object, got list" in err
    assert f"{path}:5: responses_create_params.temprature" in err
    assert f"{path}:1" not in err and f"{path}:3" not in err
    assert not (root / "out").exists() and not (root / "data/train_prepare.jsonl").exists()


def test_missing_file_names_the_config_key_that_declared_it(root: Path, capsys) -> None:
    (root / "data/validation.jsonl").unlink()
    assert run("+mode=train_preparation") == 2
    err = capsys.readouterr().err
    assert "my_env_simple_agent.responses_api_agents.simple_agent.datasets[1]" in err
    assert "cfg.yaml:" in err and "'data/validation.jsonl' does not exist" in err


def test_downloads_and_bad_options_are_refused(root: Path, capsys) -> None:
    assert run("+mode=train_preparation", "+should_download=true", "+data_source=gitlab") == 2
    err = capsys.readouterr().err
    assert "+should_download=true (from gitlab)" in err and "offline" in err
    assert run("+mode=train") == 2
    assert "+mode must be one of train_preparation, example_validation" in capsys.readouterr().err
    assert run("+mode=train_preparation", "+data_source=s3") == 2
    assert run("+mode=train_preparation", "+overwrite_metric_conflicts=true") == 2
    assert "overwrite_metrics_conflicts" in capsys.readouterr().err
    assert not (root / "out").exists()
