"""The reward audit (``ng_reward_audit``, docs/rewards.md): every environment folder has an exploit file,
and every environment's audit passes: its control earns, no exploit earns a reward or escapes scoring,
no server is down afterwards.

Then the audit itself is checked for the verdicts it must give: an exploit that earns (here: the right
answer played as an "exploit"), one that is not scored (the model answering 503, which the agent turns into
a 502), and a control that earns nothing each fail it, and the command exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nemo_gym.kit.script import ScriptedTurn
from nemo_gym.tools.reward_audit.battery import Play
from nemo_gym.tools.reward_audit.cli import format_result, main, markdown_table
from nemo_gym.tools.reward_audit.play import CONTROL_TIME_FACTOR, Outcome, _judge_times, run_audit
from nemo_gym.tools.reward_audit.spec import (
    EXPLOITS_FILE,
    Audit,
    Exploit,
    ExploitFileError,
    environment_folders,
    load_exploit_file,
)

ROOT = Path(__file__).resolve().parent.parent
SPLIT_ACROSS_WORKERS = True  # each test starts its own servers: any worker may run it (docs/testing.md)
ENVIRONMENTS = environment_folders(ROOT)
WEATHER = "resources_servers/example_single_tool_call"


def test_every_environment_has_a_valid_exploit_file() -> None:
    assert len(ENVIRONMENTS) >= 20  # the folder scan found the environments
    missing = [f.name for f in ENVIRONMENTS if not (f / EXPLOITS_FILE).is_file()]
    assert not missing, (
        f"environments without {EXPLOITS_FILE} (docs/rewards.md says how to write one): {missing}"
    )
    for folder in ENVIRONMENTS:
        audits = load_exploit_file(folder / EXPLOITS_FILE)  # raises, naming the file and field
        assert audits and all(a.exploits for a in audits), (
            f"{folder.name}: an audit with no exploits of its own"
        )


@pytest.mark.parametrize("folder", ENVIRONMENTS, ids=[f.name for f in ENVIRONMENTS])
def test_environment_passes_its_reward_audit(folder: Path) -> None:
    if not (folder / EXPLOITS_FILE).is_file():
        pytest.fail(f"{folder.name} has no {EXPLOITS_FILE}")
    reports, failed = [], False
    for audit in load_exploit_file(folder / EXPLOITS_FILE):
        result = run_audit(audit, folder, ROOT)
        reports.append(format_result(folder.name, result))
        failed |= not result.passed
        assert any(o.play.earn and o.ok for o in result.outcomes)  # the control was played and earned
        assert len(result.outcomes) > 1 + len(audit.exploits)  # the generic battery was played too
    assert not failed, "\n".join(reports)


def _weather_audit(**fields: object) -> Audit:
    audit = load_exploit_file(ROOT / WEATHER / EXPLOITS_FILE)[0]
    return audit.model_copy(update=fields)


def test_the_audit_fails_an_exploit_that_earns_one_that_is_not_scored_and_a_control_that_does_not_earn() -> (
    None
):
    right = _weather_audit().solve
    audit = _weather_audit(
        solve=[*right[:-1], ScriptedTurn(text="I could not find out.")],
        prefix=right[:-1],
        answer=right[-1].text,
        exploits=[
            Exploit(name="the_right_answer", why="solves the task: must be reported as earning", turns=right),
            Exploit(name="model_down", why="the model answers 503", turns=[ScriptedTurn(http_error=503)]),
        ],
    )
    result = run_audit(audit, ROOT / WEATHER, ROOT)
    by_name = {o.play.name: o for o in result.outcomes}
    assert not result.passed
    assert by_name["control"].reward == 0 and not by_name["control"].ok
    assert by_name["control"].verdict.startswith("FAIL (the control earned nothing")
    assert (
        by_name["the_right_answer"].reward == 1
        and by_name["the_right_answer"].verdict == "FAIL (earned a reward)"
    )
    assert by_name["model_down"].status == 502 and by_name["model_down"].verdict == "FAIL (not scored)"
    assert by_name["empty_answer"].ok and by_name["empty_answer"].reward == 0
    table = markdown_table([("example_single_tool_call", result)], "abc1234")
    assert "| example_single_tool_call | example_single_tool_call | 0 |" in table and "**FAIL**" in table


def test_the_oversized_answer_is_scored_zero_with_a_reason_before_the_verifier() -> None:
    audit = _weather_audit(exploits=[Exploit(name="noop", why="-", turns=[ScriptedTurn(text="x")])])
    result = run_audit(audit, ROOT / WEATHER, ROOT)
    oversized = next(o for o in result.outcomes if o.play.name == "oversized_answer")
    assert oversized.status == 200 and oversized.reward == 0
    assert oversized.reason.startswith("the answer is too long: the model wrote 10,0")
    control = next(o for o in result.outcomes if o.play.earn)
    assert control.reward == 1 and control.ok


def test_a_play_with_a_bound_of_its_own_fails_past_it_counted_beyond_the_controls_time() -> None:
    control = Play("control", "-", "control", [], 0, earn=True)
    slow = Play("pathological_markup", "-", "generic", [], 0, timeout_s=60.0)
    plain = Play("shotgun", "-", "generic", [], 0)
    allowed = 60.0 + CONTROL_TIME_FACTOR * 10.0

    def judged(slow_s: float) -> list[Outcome]:
        outcomes = [Outcome("a", p, 200, r, "", True) for p, r in ((control, 1.0), (slow, 0.0), (plain, 0.0))]
        return _judge_times(_weather_audit(), outcomes, {0: 10.0, 1: slow_s, 2: 500.0})

    within = judged(allowed - 1)
    assert all(o.ok for o in within)  # a play without a bound of its own is bounded by the audit only
    past = judged(allowed + 1)
    assert not past[1].ok and past[1].verdict == "FAIL (too slow)" and past[1].reward == 0
    assert f"past its bound of {allowed:.0f} s" in past[1].reason and "the control's 10.0 s" in past[1].reason
    assert past[0].ok and past[2].ok


def test_a_bad_exploit_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    bad = tmp_path / EXPLOITS_FILE
    bad.write_text("config_paths: [x.yaml]\nsolve: [{txt: hi}]\nexploits: []\n")
    with pytest.raises(ExploitFileError) as err:
        load_exploit_file(bad)
    assert str(bad) in str(err.value) and "solve.0.txt" in str(err.value)
    bad.write_text(
        "config_paths: [x.yaml]\nsandboxed: true\nsolve: [{text: hi}]\n"
        "exploits: [{name: a, why: b, turns: [{text: c}], covers: [fork_bomb]}]\n"
    )
    with pytest.raises(ExploitFileError, match="none covers: kill_own_process, endless_output"):
        load_exploit_file(bad)


def test_the_command_exits_2_for_an_unknown_environment_and_1_when_an_audit_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["+env=no_such_environment"])
    assert "no environment folder no_such_environment" in str(exit_.value.code)
    # A checkout whose one environment's exploit file plays the right answer as an exploit.
    env = tmp_path / "resources_servers" / "example_single_tool_call"
    env.mkdir(parents=True)
    for name in ("app.py", "data/example.jsonl", "configs/example_single_tool_call.yaml"):
        (env / name).parent.mkdir(parents=True, exist_ok=True)
        (env / name).write_bytes((ROOT / WEATHER / name).read_bytes())
    text = (ROOT / WEATHER / EXPLOITS_FILE).read_text()
    solve = "  - name: right\n    why: the right answer\n    turns:\n"
    solve += "      - tool_calls: [{name: get_weather, arguments: {city: Paris}}]\n"
    solve += '      - text: "Right now in Paris it is snowy, 7 degrees Celsius."\n'
    (env / EXPLOITS_FILE).write_text(text.split("exploits:")[0] + "exploits:\n" + solve)
    monkeypatch.chdir(tmp_path)
    table = tmp_path / "audit.md"
    with pytest.raises(SystemExit) as exit_:
        main([f"+markdown_fpath={table}"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "right" in out and "FAIL (earned a reward)" in out and "FAILED: example_single_tool_call" in out
    assert "**FAIL**" in table.read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
