"""ng_reverify end to end: rollouts collected from real servers, then scored again from the saved file.

Proven here: payloads are the task rows (materialized inputs) plus the recorded response; a changed
verdict shows as ``previous_reward`` -> ``reward`` in a new file, in input order; ``+where`` limits what
is re-verified; the input is never touched; bad options and lines are refused (exit 2) before anything
is posted; a verifier that cannot score a line sends it to the failures file (exit 1), never reward 0;
a server whose verify needs live session state is refused unless ``+force=true``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.rollout_collection import collect_main
from nemo_gym.tools.reverify import main as reverify_main
from nemo_gym.tools.testing import running_servers

WEATHER = "example_single_tool_call"
COUNTER = "example_session_state_mgmt"
CONFIGS = [f"resources_servers/{e}/configs/{e}.yaml" for e in (WEATHER, COUNTER)]


def _run(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def test_reverify_saved_rollouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_servers(CONFIGS) as helper:
        port = ["+head_server.port=" + str(helper.head_server_config.port)]
        rollouts = tmp_path / "rollouts.jsonl"
        code, out, err = _run(
            collect_main,
            [f"+agent_name={WEATHER}_simple_agent", f"+input_jsonl_fpath=resources_servers/{WEATHER}/data/example.jsonl",
             f"+output_jsonl_fpath={rollouts}", "+num_repeats=2", "+progress=false", *port],
            capsys,
        )  # fmt: skip
        assert code == 0, err
        collected = sorted(_lines(rollouts), key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]))
        assert len(collected) == 10
        # A verifier "fix" seen from the data side: the stored verdicts of two lines are not what the
        # verifier says today; re-verifying must bring back the verifier's reward.
        stored = [dict(r) for r in collected]
        stored[1]["reward"], stored[6]["reward"] = 0.25, -1.0
        _write(rollouts, stored)
        before = rollouts.read_bytes()

        out_path = tmp_path / "reverified.jsonl"
        code, out, err = _run(
            reverify_main,
            [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={out_path}", *port],
            capsys,
        )
        assert code == 0, err
        assert rollouts.read_bytes() == before  # the input is never rewritten
        new = _lines(out_path)
        assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in new] == [
            (r["_ng_task_index"], r["_ng_rollout_index"]) for r in stored
        ]
        assert [r["reward"] for r in new] == [r["reward"] for r in collected]
        assert [r["previous_reward"] for r in new] == [r["reward"] for r in stored]
        assert new[0]["expected_city"] == collected[0]["expected_city"]  # task fields kept
        assert "2 reward(s) changed" in out and "line 2: 0.25 -> " in out and "line 7: -1.0 -> " in out

        # +where: only the matching line is scored again; the others are copied as they are.
        only = tmp_path / "only.jsonl"
        code, out, err = _run(reverify_main, [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={only}", "+where.reward=0.25", *port], capsys)  # fmt: skip
        assert code == 0, err
        new = _lines(only)
        assert [("previous_reward" in r) for r in new] == [i == 1 for i in range(10)]
        assert new[6]["reward"] == -1.0 and new[1]["reward"] == collected[1]["reward"]

        # A task row the verifier refuses (its expected_city was lost): a failure, left out, never 0.
        inputs = tmp_path / "rollouts_materialized_inputs.jsonl"
        rows = _lines(inputs)
        broken = next(r for r in rows if (r["_ng_task_index"], r["_ng_rollout_index"]) == (0, 1))
        del broken["expected_city"]
        _write(inputs, rows)
        failed_out = tmp_path / "failed.jsonl"
        code, out, err = _run(reverify_main, [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={failed_out}", *port], capsys)  # fmt: skip
        assert code == 1 and "1 line(s) failed" in err
        assert len(_lines(failed_out)) == 9 and all(
            (r["_ng_task_index"], r["_ng_rollout_index"]) != (0, 1) for r in _lines(failed_out)
        )
        failures = _lines(tmp_path / "failed_failures.jsonl")
        assert [(f["_ng_task_index"], f["_ng_rollout_index"], f["line"]) for f in failures] == [(0, 1, 2)]
        assert "422" in failures[0]["error"]

        # Bad options and lines: exit 2, nothing posted or written.
        code, _, err = _run(reverify_main, [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={rollouts}", *port], capsys)  # fmt: skip
        assert code == 2 and "must differ" in err
        code, _, err = _run(reverify_main, [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={out_path}", *port], capsys)  # fmt: skip
        assert code == 2 and "+overwrite=true" in err
        code, _, err = _run(reverify_main, [f"+input_jsonl_fpath={rollouts}", f"+output_jsonl_fpath={tmp_path / 'x.jsonl'}", "+wher.reward=1", *port], capsys)  # fmt: skip
        assert code == 2 and "+wher" in err
        no_agent = tmp_path / "no_agent.jsonl"
        _write(no_agent, [{k: v for k, v in stored[0].items() if k != "agent_ref"}])
        code, _, err = _run(reverify_main, [f"+input_jsonl_fpath={no_agent}", f"+output_jsonl_fpath={tmp_path / 'y.jsonl'}", *port], capsys)  # fmt: skip
        assert code == 2 and f"{no_agent}: line 1" in err and "agent_ref" in err
        assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "y.jsonl").exists()

        # A verifier that needs the rollout's live session: refused unless forced.
        counter = tmp_path / "counter.jsonl"
        code, _, err = _run(
            collect_main,
            [f"+agent_name={COUNTER}_simple_agent", f"+input_jsonl_fpath=resources_servers/{COUNTER}/data/example.jsonl",
             f"+output_jsonl_fpath={counter}", "+progress=false", *port],
            capsys,
        )  # fmt: skip
        assert code == 0, err
        code, _, err = _run(reverify_main, [f"+input_jsonl_fpath={counter}", f"+output_jsonl_fpath={tmp_path / 'c.jsonl'}", *port], capsys)  # fmt: skip
        assert code == 2 and "unsupported" in err and "+force=true" in err
        assert not (tmp_path / "c.jsonl").exists()


# Upstream's string_match case, written small: its verify response does not echo the task field
# ``extraction_mode``, so its recorded rollouts lack it, and re-verifying a line on its own applies the
# default mode ("final_answer") to a "last_line" task: 1.0 became 0.0. The task row must be posted.
def _upstream_like_line(task_index: int) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": "Name the largest ocean."},
        "response": {"output": [{"type": "message", "role": "assistant", "content": "Pacific Ocean"}]},
        "reward": 1.0,
        "expected_answer": "Pacific Ocean",
        "_ng_task_index": task_index,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "string_match_simple_agent"},
    }


def test_plain_task_file_supplies_the_fields_a_verifier_dropped(tmp_path: Path) -> None:
    from nemo_gym.tools.reverify import ReverifyError, default_inputs_path, plan

    tasks = [{"responses_create_params": {"input": f"q{i}"}, "expected_answer": f"a{i}",
              "extraction_mode": "boxed" if i < 2 else "last_line"} for i in range(3)]  # fmt: skip
    lines = [_upstream_like_line(2), _upstream_like_line(0)]
    source = tmp_path / "example_rollouts.jsonl"
    todo = plan(lines, tasks, {}, source)
    assert [(i, p["extraction_mode"], p["expected_answer"]) for i, p in todo] == [
        (0, "last_line", "a2"),
        (1, "boxed", "a0"),
    ]
    assert all(p["response"] == lines[i]["response"] and "reward" not in p for i, p in todo)
    # Without task rows the line is posted as recorded (the warning in main() says what that means).
    assert "extraction_mode" not in plan(lines, None, {}, source)[0][1]
    with pytest.raises(ReverifyError, match=r"line 1: its _ng_task_index 7 is not a row of the task file"):
        plan([_upstream_like_line(7)], tasks, {}, source)
    with pytest.raises(ReverifyError, match="mixes rows"):
        plan(lines, [*tasks, {**tasks[0], "_ng_task_index": 0, "_ng_rollout_index": 0}], {}, source)

    # Upstream's layout: data/example.jsonl beside data/example_rollouts.jsonl is found by itself;
    # the collector's materialized inputs win when both are there.
    assert default_inputs_path(source) is None
    _write(tmp_path / "example.jsonl", tasks)
    assert default_inputs_path(source) == tmp_path / "example.jsonl"
    _write(tmp_path / "example_rollouts_materialized_inputs.jsonl", tasks)
    assert default_inputs_path(source) == tmp_path / "example_rollouts_materialized_inputs.jsonl"
    assert default_inputs_path(tmp_path / "rollouts.jsonl") is None


def test_reverify_without_task_rows_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rollouts = tmp_path / "lone.jsonl"
    _write(rollouts, [_upstream_like_line(0)])
    with socket.socket() as s:  # a port nothing listens on: it stops after the warning
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        f"+input_jsonl_fpath={rollouts}",
        f"+output_jsonl_fpath={tmp_path / 'o.jsonl'}",
        f"+head_server.port={port}",
    ]
    code, _, err = _run(reverify_main, args, capsys)
    assert code == 2 and "warning: no task rows" in err and "+inputs_jsonl_fpath=<the task JSONL>" in err
    assert not (tmp_path / "o.jsonl").exists()


PEAK_RSS = """
import resource, sys
from nemo_gym.tools.reverify import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code or 0
sys.stderr.write(f"PEAK_RSS_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n")
sys.exit(code)
"""


def test_memory_does_not_grow_with_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 10 MB and a 100 MB rollouts file (64 KB lines; one line in 25 re-verified, the others copied):
    ng_reverify's peak memory grows by far less than the file did, and the output is complete and in order."""
    import subprocess
    import sys

    from nemo_gym.auth import AUTH_TOKEN_ENV_VAR_NAME, client_token

    with running_servers(CONFIGS) as helper:
        head_port = helper.head_server_config.port
        port = ["+head_server.port=" + str(head_port)]
        rollouts = tmp_path / "rollouts.jsonl"
        code, _, err = _run(
            collect_main,
            [f"+agent_name={WEATHER}_simple_agent", f"+input_jsonl_fpath=resources_servers/{WEATHER}/data/example.jsonl",
             f"+output_jsonl_fpath={rollouts}", "+progress=false", *port],
            capsys,
        )  # fmt: skip
        assert code == 0, err
        collected = _lines(rollouts)
        pad = "x" * 65536

        def peak_rss_mb(n: int) -> tuple[float, Path]:
            big = tmp_path / f"big{n}.jsonl"
            with open(big, "wb") as f:
                for i in range(n):
                    row = {**collected[i % len(collected)], "pad": pad, "recheck": i % 25 == 0, "seq": i}
                    f.write(orjson.dumps(row) + b"\n")
            out = tmp_path / f"out{n}.jsonl"
            env = {**os.environ, AUTH_TOKEN_ENV_VAR_NAME: client_token(head_port) or ""}
            proc = subprocess.run(
                [sys.executable, "-c", PEAK_RSS, f"+input_jsonl_fpath={big}", f"+output_jsonl_fpath={out}",
                 f"+inputs_jsonl_fpath={tmp_path / 'rollouts_materialized_inputs.jsonl'}",
                 "+where.recheck=true", "+num_samples_in_parallel=8", *port],
                capture_output=True, text=True, timeout=300, env=env,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            with open(out, "rb") as f:
                seqs = [orjson.loads(line)["seq"] for line in f]
            assert seqs == list(range(n))
            assert f"re-verified {len(range(0, n, 25))} line(s)" in proc.stdout, proc.stdout
            return int(proc.stderr.rsplit("PEAK_RSS_KB ", 1)[1].split()[0]) / 1024, big

        small_mb, small = peak_rss_mb(150)
        large_mb, large = peak_rss_mb(1500)
        file_growth_mb = (large.stat().st_size - small.stat().st_size) / 2**20
        assert large_mb - small_mb < 0.25 * file_growth_mb, (small_mb, large_mb, file_growth_mb)


@pytest.mark.parametrize("agent_ref", ["x", ["a"], {"name": 5}, None, {}])
def test_a_line_with_a_malformed_agent_ref_is_named_not_a_crash(agent_ref: object, tmp_path: Path) -> None:
    """Before: ``"agent_ref": "x"`` ended ng_reverify with an AttributeError traceback (exit 1)."""
    from nemo_gym.tools.reverify import payload_for

    line = {"agent_ref": agent_ref, "response": {"output": []}, "reward": 1.0}
    payload, why = payload_for(line, 7, None, tmp_path / "rollouts.jsonl")
    assert payload is None and why is not None
    assert "line 7" in why and "agent_ref.name" in why
