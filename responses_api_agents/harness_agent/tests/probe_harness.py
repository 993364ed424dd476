"""A harness that does what a hostile model's commands would, then answers: run by tests/test_app.py.

Its task text (stdin) is a JSON object saying what to try. It reports on stderr (one line,
``PROBE {...}``) what it could reach: the host paths of ``paths`` (the repository's answer key, the
run's token file, the host user's home), what the glob patterns of ``globs`` find (another rollout's
files where the host keeps them), the entries of ``/``, of ``home`` and of the directories of ``list``, the working directories of
every process it can see (how an audit found the repository: ``/proc/<pid>/cwd``), the HTTP status of
``POST /policy_version`` and ``POST /ng_model_calls/pop`` through its model URL and of another
rollout's model call with its own credential, and whether a TCP connection to each ``host:port`` of
``addresses`` (the run's servers on the host) opens. It leaves ``setsid python -c 'time.sleep(1000)' <marker>`` behind (the
test looks for it on the host afterwards), then makes one model call of its own rollout with
``question`` and prints the answer.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import openai


def _status(url: str, body: dict, key: str) -> str:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return f"HTTP {answer.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, urllib.error.URLError) as e:
        return f"unreachable: {type(e).__name__}"


def _can_connect(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return True
    except OSError:
        return False


def _readable(path: str) -> bool:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        return True
    except OSError:
        return False


def _listing(path: str) -> list[str] | None:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return None


def main() -> None:
    probe = json.loads(sys.stdin.read())
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    root = base.split("/ng-rollout/", 1)[0]
    other = base.replace(os.environ["NG_ROLLOUT_ID"], "someone-elses-rollout")
    cwds = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cwds.add(os.readlink(f"/proc/{pid}/cwd"))
            except OSError:
                pass
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", probe["marker"]]
    subprocess.Popen(
        ["setsid", *sleeper], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    report = {
        "readable": {p: _readable(p) for p in probe["paths"]},
        "found": sorted(f for pattern in probe["globs"] for f in glob.glob(pattern)),
        "top": _listing("/"),
        "home": _listing(probe["home"]),
        "listings": {p: _listing(p) for p in probe["list"]},
        "cwds": sorted(cwds),
        "policy_version": _status(root + "/policy_version", {"policy_version": 99}, key),
        "pop": _status(root + "/ng_model_calls/pop", {"rollout_ids": ["x"]}, key),
        "other_rollout": _status(other + "/chat/completions", {"model": "m", "messages": []}, key),
        "connect": {a: _can_connect(a) for a in probe["addresses"]},
    }
    print("PROBE " + json.dumps(report), file=sys.stderr, flush=True)
    answer = openai.OpenAI().chat.completions.create(
        model=os.environ["NG_MODEL"], messages=[{"role": "user", "content": probe["question"]}]
    )
    print(answer.choices[0].message.content)


if __name__ == "__main__":
    main()
