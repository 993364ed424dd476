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
