"""ng_bench_sandbox runs end to end (tiny sizes) and writes its measurements; nothing about speed is asserted."""

from __future__ import annotations

import orjson

from nemo_gym.tools.bench.sandbox import main


def test_bench_writes_every_measurement(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    main(["+runs=2", "+throughput_runs=2", "+concurrency=2", "+verify_calls=5", f"+output_json_fpath={out}"])
    data = orjson.loads(out.read_bytes())
    for name in ("print(1)", "sort 200k ints"):
        row = data["overhead"][name]
        assert row["bare_ms_mean"] > 0 and row["sandbox_ms_mean"] > 0 and row["ratio_mean"] > 0
        assert row["bare_cpu_ms_per_run"] > 0 and row["sandbox_cpu_ms_per_run"] > 0 and row["cpu_ratio"] > 0
    assert data["throughput"]["bare"]["runs"] == data["throughput"]["sandbox"]["runs"] >= 2
    assert data["throughput"]["sandbox"]["cores_busy"] > 0  # the sandboxed trees' CPU, from their cgroups
    assert data["code_gen_verify"]["verify_calls"] == 5 and data["code_gen_verify"]["tests_per_s"] > 0
    assert "sandboxed / bare throughput" in capsys.readouterr().out


def test_bench_session_mode_writes_every_measurement(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    main(
        [
            "+mode=session",
            "+sessions=2",
            "+commands=4",
            "+fork_files=40",
            "+fork_mib=1",
            f"+output_json_fpath={out}",
        ]
    )
    data = orjson.loads(out.read_bytes())
    assert data["mode"] == "session"
    assert all(r["ratio_p50"] > 0 for r in data["sequential"].values())
    every = data["latency"]["per_command"]["all"]
    assert every["bare_p50_ms"] > 0 and every["session_p50_ms"] > 0 and every["ratio_p99"] > 0
    assert data["latency"]["sessions_per_gib"]["pss_kernel"] > 0
    forks = data["forks"]
    assert forks["fork_ms"]["p50"] > 0 and forks["fork_cpu_ms_p50"] > 0
    assert forks["fork_disk_kib"]["before_write"] == 0  # a fork copies nothing
    assert "fork of a 1 MiB / 40-file workspace" in capsys.readouterr().out
