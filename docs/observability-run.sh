#!/usr/bin/env bash
# The run behind docs/observability-run.png (see docs/observability.md, "Plots of a run").
# From the repository root, in the venv, with Debian's prometheus: bash docs/observability-run.sh [out.png]
# ng_run (example_single_tool_call + simple_agent + the scripted model), Prometheus scraping every server
# and the collector every 1 s, then three phases of ng_collect_rollouts, then the plot:
#   fast   60 s, 8 in parallel, right answers (reward 1)
#   slow   50 s, 16 in parallel, the model waits 0.5 s before its first turn (latency, in-flight up)
#   wrong  50 s, 8 in parallel, the model asks for the weather of the wrong city (reward 0)
set -euo pipefail
out=${1:-docs/observability-run.png}
head_port=${HEAD_PORT:-11000} prom_port=${PROM_PORT:-19090} coll_port=${COLLECTOR_PORT:-19091}
work=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait || true; rm -rf "$work"' EXIT  # the rows take ~180 MB

python - "$work" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
base = [json.loads(l) for l in Path("resources_servers/example_single_tool_call/data/example.jsonl").read_text().splitlines()]
sys.path.insert(0, ".")
from resources_servers.example_single_tool_call.app import weather_report
rules = []
for row in base:
    city = row["expected_city"]
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}
    answer = {"text": weather_report(city)}
    rules.append({"contains": f"[fast {city}]", "turns": [call, answer]})
    rules.append({"contains": f"[slow {city}]", "turns": [{**call, "delay_s": 0.5}, answer]})
    rules.append({"contains": f"[wrong {city}]", "turns": [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Atlantis"}}]}, answer]})
(work / "scripts.yaml").write_text(json.dumps({"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}))
for phase in ("fast", "slow", "wrong"):
    with (work / f"{phase}.jsonl").open("w") as f:
        for i in range(30_000):  # more than a phase gets through: each phase is stopped by time
            row = json.loads(json.dumps(base[i % len(base)]))
            row["responses_create_params"]["input"][-1]["content"] += f" [{phase} {row['expected_city']}] {i}"
            f.write(json.dumps(row) + "\n")
PY

ng_run "+config_paths=[resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml,responses_api_models/scripted_model/configs/scripted_model.yaml,$work/scripts.yaml]" \
  +head_server.port="$head_port" >"$work/ng_run.log" 2>&1 &
pids+=($!)
until grep -q "servers ready!" "$work/ng_run.log"; do sleep 1; done
token_file=$(python -c "from nemo_gym.auth import token_file_for; print(token_file_for($head_port))")

cat >"$work/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: nemo_gym
    authorization: {type: Bearer, credentials_file: $token_file}
    http_sd_configs:
      - url: http://127.0.0.1:$head_port/prometheus_targets
        refresh_interval: 1s
        authorization: {type: Bearer, credentials_file: $token_file}
  - job_name: nemo_gym_collector
    static_configs:
      - targets: ["127.0.0.1:$coll_port"]
        labels: {instance_name: collector}
YML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=($!)
sleep 5
start=$(date +%s)

collect() {  # phase, seconds, rollouts in parallel; stopped with SIGINT (exit 130) when its time is up
  timeout -s INT "$2" ng_collect_rollouts +agent_name=example_single_tool_call_simple_agent \
    +input_jsonl_fpath="$work/$1.jsonl" +output_jsonl_fpath="$work/$1-out.jsonl" \
    +head_server.port="$head_port" +metrics_port="$coll_port" +num_samples_in_parallel="$3" +progress=false \
    >"$work/$1.log" 2>&1 || { rc=$?; [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ]; }
}
collect fast 60 8
collect slow 50 16
collect wrong 50 8
sleep 10
python -m nemo_gym.tools.metrics_plots --prometheus "http://127.0.0.1:$prom_port" --start "$start" \
  --end "$(date +%s)" --step 2 --window 15s --out "$out" \
  --title "example_single_tool_call + scripted model: fast / slow / wrong phases ($(date -u +%F), $(nproc) cores)"
