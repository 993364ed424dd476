"""tests/suite_profile.py: docs/testing.md's tables from a ``--durations=0`` report."""

from __future__ import annotations

from pathlib import Path

from tests.suite_profile import kind_of, read, tables

REPORT = """\
============================== slowest durations ===============================
40.00s call     tests/test_reward_audit.py::test_environment_passes_its_reward_audit[aviary]
30.00s call     responses_api_models/local_model/tests/test_app.py::test_a[n_batch_8]
20.00s setup    tests/test_ray.py::test_b
6.00s call      tests/test_config.py::test_c
4.00s teardown  tests/test_config.py::test_c
not a duration line
"""


def test_tables_sum_by_kind_phase_and_file(tmp_path: Path) -> None:
    report = tmp_path / "run.txt"
    report.write_text(REPORT)
    rows = read(report)
    assert len(rows) == 5 and rows[-1] == (4.0, "teardown", "tests/test_config.py")
    out = tables(rows)
    assert "Test time summed over workers: 100 s in 4 files." in out
    assert "| local model generation (llama.cpp on the CPU) | 1 | 30 | 30.0% |" in out
    assert "| Ray cluster (two nodes per module) | 1 | 20 | 20.0% |" in out
    assert "| servers started per test or module (ng_run, scripted model, HTTP) | 1 | 10 | 10.0% |" in out
    assert "| call | 76 | 76.0% |" in out and "| setup | 20 | 20.0% |" in out
    assert "| `tests/test_config.py` | 10 | 10.0% |" in out
    # Kinds: the first pattern that matches; everything else is a server test.
    assert kind_of("tests/test_viewer_browser.py").startswith("Chromium")
    assert kind_of("resources_servers/workspace_tasks/tests/test_app.py").startswith("sandboxes")
    assert kind_of("tests/test_anything_else.py").startswith("servers started")
