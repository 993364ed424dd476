"""python -m nemo_gym.tools.bench.startup: one launch of the example end to end; the result has every
field and every phase. Times are not asserted (the machine's load decides them)."""

from __future__ import annotations

from pathlib import Path

import orjson

from nemo_gym.tools.bench.startup import _phases, main, measure_startup

SERVERS = {"example_single_tool_call", "example_single_tool_call_simple_agent", "policy_model"}


def test_phases_follow_the_order_the_marks_were_written() -> None:
    """ng_run spawns the servers before its head server starts: each phase ends at its own mark and
    starts at the mark written before it, whatever the order."""
    marks = [
        {"t": 10.5, "server": "launcher", "event": "main"},
        {"t": 10.7, "server": "launcher", "event": "config"},
        {"t": 10.8, "server": "launcher", "event": "ports"},
        {"t": 10.9, "server": "a", "event": "spawn"},
        {"t": 11.5, "server": "launcher", "event": "head"},
        {"t": 11.9, "server": "a", "event": "imports"},
        {"t": 12.0, "server": "a", "event": "config"},
        {"t": 12.1, "server": "launcher", "event": "verdicts"},
        {"t": 12.1, "server": "a", "event": "go"},
        {"t": 12.3, "server": "a", "event": "app"},
        {"t": 12.4, "server": "a", "event": "serving"},
        {"t": 12.45, "server": "a", "event": "ready"},
        {"t": 12.5, "server": "launcher", "event": "ready_all"},
    ]
    phases = _phases(marks, launched_at=10.0)
    launcher = {k: round(v, 3) for k, v in phases["launcher"].items()}
    assert launcher == {
        "python_and_imports": 0.5,
        "config": 0.2,
        "ports": 0.1,
        "spawn": 0.1,
        "head_server": 0.6,
        "config_verdicts": 0.6,
        "servers_ready": 0.4,
    }
    server = {k: round(v, 3) for k, v in phases["a"].items()}
    assert server == {
        "python_and_imports": 1.0,
        "config": 0.1,
        "wait_go": 0.1,
        "build_app": 0.2,
        "start_serving": 0.1,
        "seen_ready": 0.05,
    }


def test_measure_startup_launches_the_example_and_reports_every_process_and_phase(tmp_path: Path) -> None:
    result = measure_startup(runs=1, imports=True)
    assert result["runs"] == 1 and result["time_to_ready_s"]["median"] > 0
    assert set(result["servers"]) == SERVERS
    assert set(result["processes"]) >= SERVERS | {"launcher", "total"}
    for row in result["processes"].values():
        assert row["uss_mib"] > 0 and row["rss_mib"] >= row["uss_mib"] and row["cpu_s"] > 0
    assert set(result["phases"]["launcher"]) == {
        "python_and_imports",
        "config",
        "ports",
        "spawn",
        "head_server",
        "config_verdicts",
        "servers_ready",
    }
    for name in SERVERS:
        assert set(result["phases"][name]) == {
            "python_and_imports",
            "config",
            "wait_go",
            "build_app",
            "start_serving",
            "seen_ready",
        }
    assert set(result["imports"]) == SERVERS | {"launcher"}
    assert all(p["ok"] and p["modules"] > 0 for p in result["imports"].values())
    # The command writes the same dict as JSON (its table goes to stdout).
    out = tmp_path / "startup.json"
    main(["+runs=1", f"+output_json_fpath={out}"])
    assert orjson.loads(out.read_bytes())["runs"] == 1
