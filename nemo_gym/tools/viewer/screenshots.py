"""Screenshots of the viewer for the docs: ``python -m nemo_gym.tools.viewer.screenshots [--out docs]``.

Writes demo rollouts files (see :mod:`nemo_gym.tools.viewer.demo`; one malformed line and a failures
sidecar included) to a temp directory, starts ``ng_viewer`` on them, and saves
``viewer-list.png``, ``viewer-trajectory.png``, ``viewer-summary.png`` and ``viewer-compare.png``
taken by headless Chromium.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path

import orjson

from nemo_gym.tools.viewer.browser import browser_context, chromium_missing_reason
from nemo_gym.tools.viewer.demo import write_demo
from nemo_gym.tools.viewer.process import ViewerProcess

WAIT_MS = 30_000


def _failures(path: Path) -> None:
    rows = [
        {
            "_ng_task_index": 12,
            "_ng_rollout_index": 1,
            "agent_ref": {"type": "responses_api_agents", "name": "travel_desk_simple_agent"},
            "attempt": 1,
            "kind": "timeout",
            "server": "policy_model",
            "path": "/v1/responses",
            "status": None,
            "error": "no response within 600 s",
        },
        {
            "_ng_task_index": 31,
            "_ng_rollout_index": 3,
            "agent_ref": {"type": "responses_api_agents", "name": "travel_desk_simple_agent"},
            "attempt": 2,
            "kind": "server_error",
            "server": "travel_desk",
            "path": "/verify",
            "status": 500,
            "error": "KeyError: 'expected_city'",
        },
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def take(out_dir: Path) -> list[Path]:
    """Generate demo data, start the viewer, save the screenshots; returns their paths."""
    reason = chromium_missing_reason()
    if reason:
        raise SystemExit(f"cannot take screenshots: {reason}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ng_viewer_shots_"))
    saved: list[Path] = []
    try:
        a, b = tmp / "travel_desk_rollouts.jsonl", tmp / "travel_desk_rollouts_v2.jsonl"
        write_demo(a, 60, 4, row_bytes=3500, seed=0, malformed_lines=(57,))
        write_demo(b, 60, 4, row_bytes=3500, seed=1)
        _failures(tmp / "travel_desk_rollouts_failures.jsonl")
        with ViewerProcess([f"+jsonl_fpath={a}", f"+compare_jsonl_fpath={b}", f"+index_dir={tmp}"]) as viewer:
            with urllib.request.urlopen(
                viewer.url + "api/files/1/rows?errors=1&reward_max=0.5&limit=20", timeout=30
            ) as resp:
                rows = json.load(resp)["rows"]
            pick = next((r for r in rows if r["tool_calls"] == 2 and r["tool_errors"]), rows[0])
            with browser_context(width=1440, height=1000) as ctx:
                page = ctx.new_page()
                page.goto(viewer.url + "#/list?sort=reward&q=Lagos")
                page.wait_for_selector("#search-done", timeout=WAIT_MS)
                page.keyboard.press("j")
                page.keyboard.press("j")
                saved.append(out_dir / "viewer-list.png")
                page.screenshot(path=str(saved[-1]))

                page.goto(viewer.url + f"#/rollout/{pick['row']}?errors=1")
                page.wait_for_selector("#verify", timeout=WAIT_MS)
                page.keyboard.press("e")  # open the reasoning
                page.set_viewport_size({"width": 1440, "height": 1500})
                saved.append(out_dir / "viewer-trajectory.png")
                page.screenshot(path=str(saved[-1]))
                page.set_viewport_size({"width": 1440, "height": 1000})

                page.goto(viewer.url + "#/summary")
                page.wait_for_selector("#tasks tbody tr", timeout=WAIT_MS)
                saved.append(out_dir / "viewer-summary.png")
                page.screenshot(path=str(saved[-1]))

                page.goto(viewer.url + "#/compare?sort=delta")
                page.wait_for_selector("#cmp-table tbody tr", timeout=WAIT_MS)
                saved.append(out_dir / "viewer-compare.png")
                page.screenshot(path=str(saved[-1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return saved


def main(argv: list[str] | None = None) -> None:
    """Command line."""
    ap = argparse.ArgumentParser(description="Save screenshots of ng_viewer on demo data.")
    ap.add_argument("--out", default="docs", help="directory for the PNG files (default: docs)")
    args = ap.parse_args(argv)
    for p in take(Path(args.out)):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
