"""Benchmark of ``ng_viewer`` on a big file: ``python -m nemo_gym.tools.bench.viewer``.

Generates (or reuses) a rollouts file of 100,000 rollouts of about 10.8 KB each (>= 1 GB) in
/tmp, then measures, with a real ``ng_viewer`` process and headless Chromium:

* cold start (no cached index): time from starting the process to the first table row painted,
  the indexing time, and the server's RSS (now and peak);
* typical interactions: sort by reward, a reward filter, a full-text search over the whole file
  (time until the scan is done), opening one rollout — and the RSS after them;
* warm start (cached index): time to the first row painted, and RSS.

Times are one run on this machine; they are reported, never asserted. ``--json <path>`` writes
the numbers as JSON as well.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from nemo_gym.tools.viewer.browser import browser_context, chromium_missing_reason
from nemo_gym.tools.viewer.demo import write_demo
from nemo_gym.tools.viewer.process import ViewerProcess

DEFAULT_FILE = "/tmp/ng_viewer_bench/rollouts_100k.jsonl"
N_TASKS, REPEATS, ROW_BYTES = 25_000, 4, 10_800
WAIT_MS = 600_000  # bound on any one wait in the browser (a cold index of 1 GB takes seconds, not minutes)
FIRST_ROW = "#rows-box tbody tr"


def _mem(pid: int) -> dict[str, float]:
    """RSS and peak RSS (VmHWM) of ``pid`` in MiB."""
    out = {"rss_mib": psutil.Process(pid).memory_info().rss / 2**20}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["peak_rss_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def ensure_file(path: Path, regenerate: bool) -> dict[str, Any]:
    """Write the benchmark file unless a complete one is there; returns its facts."""
    marker = path.with_suffix(".complete")
    t0 = time.monotonic()
    generated = False
    if regenerate or not (
        path.exists() and marker.exists() and marker.read_text() == str(path.stat().st_size)
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)
        write_demo(path, N_TASKS, REPEATS, row_bytes=ROW_BYTES, seed=0, malformed_lines=(12_345, 67_890))
        marker.write_text(str(path.stat().st_size))
        generated = True
    return {
        "path": str(path),
        "rollouts": N_TASKS * REPEATS,
        "bytes": path.stat().st_size,
        "gib": path.stat().st_size / 2**30,
        "generated_now": generated,
        "generate_s": time.monotonic() - t0 if generated else None,
    }


def _fcp(page: Any) -> float | None:
    value = page.evaluate(
        "() => { const e = performance.getEntriesByName('first-contentful-paint')[0]; return e ? e.startTime : null; }"
    )
    return None if value is None else value / 1000


def _first_rows(page: Any, url: str) -> dict[str, Any]:
    t_nav = time.monotonic()
    page.goto(url)
    page.wait_for_selector(FIRST_ROW, timeout=WAIT_MS)
    return {"t_rows": time.monotonic(), "nav_to_rows_s": time.monotonic() - t_nav, "fcp_s": _fcp(page)}


def _timed_change(page: Any, url: str, done_selector: str) -> float:
    """Seconds from navigating to ``url`` until ``done_selector`` matches freshly rendered content.

    Everything on the page is marked stale first, so a selector that matched before the change
    cannot end the wait early.
    """
    page.evaluate(
        "() => document.querySelectorAll('#app *').forEach((e) => e.setAttribute('data-stale', ''))"
    )
    t = time.monotonic()
    page.goto(url)
    page.wait_for_selector(f"{done_selector}:not([data-stale])", timeout=WAIT_MS)
    return time.monotonic() - t


def run_viewer(path: Path, index_dir: Path, interactions: bool) -> dict[str, Any]:
    """Start a viewer on ``path``, open the page, measure; the viewer is stopped on return.

    The browser is started first, so its own start-up is not counted in the viewer's times.
    """
    res: dict[str, Any] = {}
    with browser_context(width=1440, height=900) as ctx:
        page = ctx.new_page()
        page.goto("about:blank")
        t0 = time.monotonic()
        with ViewerProcess(
            [f"+jsonl_fpath={path}", f"+index_dir={index_dir}"], start_timeout_s=120
        ) as viewer:
            res["process_start_to_url_s"] = time.monotonic() - t0
            first = _first_rows(page, viewer.url)
            res["process_start_to_first_rows_s"] = first["t_rows"] - t0
            res["navigation_to_first_rows_s"] = first["nav_to_rows_s"]
            res["first_contentful_paint_s"] = first["fcp_s"]
            status = json.loads(
                page.evaluate("async () => JSON.stringify(await (await fetch('/api/files/1')).json())")
            )
            res["index_seconds"] = status["index_seconds"]
            res["loaded_from_cache"] = status["loaded_from_cache"]
            res["rows"] = status["rows"]
            res["malformed"] = status["malformed"]
            res["index_cache_bytes"] = Path(status["index_cache"]).stat().st_size
            res["memory_after_first_paint"] = _mem(viewer.pid)
            if interactions:
                res["sort_by_reward_s"] = _timed_change(
                    page, viewer.url + "#/list?sort=reward&desc=1", FIRST_ROW
                )
                res["reward_filter_s"] = _timed_change(
                    page, viewer.url + "#/list?reward_max=0.5&sort=total_tokens&desc=1", FIRST_ROW
                )
                res["full_text_search_s"] = _timed_change(
                    page, viewer.url + "#/list?q=TRV-012345", "#search-done"
                )
                res["full_text_search_matches"] = page.inner_text("#search-done")
                search = json.loads(
                    page.evaluate(
                        "async () => JSON.stringify(await (await fetch('/api/files/1/rows?q=TRV-012345&limit=1')).json())"
                    )
                )
                res["full_text_search_scan_s"] = search["search"]["seconds"]
                res["open_rollout_s"] = _timed_change(page, viewer.url + "#/rollout/54321", "#verify")
                res["summary_s"] = _timed_change(page, viewer.url + "#/summary", "#tasks tbody tr")
                res["memory_after_interactions"] = _mem(viewer.pid)
    return res


def main(argv: list[str] | None = None) -> None:
    """Command line."""
    ap = argparse.ArgumentParser(description="Benchmark ng_viewer on a 100,000-rollout (>= 1 GB) file.")
    ap.add_argument("--file", default=DEFAULT_FILE, help=f"where the big file lives (default {DEFAULT_FILE})")
    ap.add_argument("--regenerate", action="store_true", help="write the file even if a complete one exists")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    reason = chromium_missing_reason()
    if reason:
        raise SystemExit(f"cannot run the benchmark: {reason}")
    path = Path(args.file)
    results: dict[str, Any] = {"file": ensure_file(path, args.regenerate)}
    print(
        f"file: {path} — {results['file']['rollouts']:,} rollouts, {results['file']['gib']:.2f} GiB"
        + (
            f" (generated in {results['file']['generate_s']:.1f} s)"
            if results["file"]["generated_now"]
            else ""
        ),
        flush=True,
    )
    index_dir = Path(tempfile.mkdtemp(prefix="ng_viewer_bench_index_"))
    try:
        results["cold"] = run_viewer(path, index_dir, interactions=True)
        results["warm"] = run_viewer(path, index_dir, interactions=False)
    finally:
        shutil.rmtree(index_dir, ignore_errors=True)
    c, w = results["cold"], results["warm"]
    lines = [
        f"cold (no index): URL printed {c['process_start_to_url_s']:.2f} s after start; first rows painted "
        f"{c['process_start_to_first_rows_s']:.2f} s after start "
        f"(indexing {c['index_seconds']:.2f} s; FCP of the page {c['first_contentful_paint_s'] or float('nan'):.3f} s)",
        f"  RSS after first paint {c['memory_after_first_paint']['rss_mib']:.0f} MiB "
        f"(peak {c['memory_after_first_paint'].get('peak_rss_mib', float('nan')):.0f} MiB); index cache {c['index_cache_bytes'] / 2**20:.1f} MiB",
        f"  sort by reward {c['sort_by_reward_s']:.2f} s, reward filter {c['reward_filter_s']:.2f} s, "
        f"full-text search {c['full_text_search_s']:.2f} s in the page / {c['full_text_search_scan_s']:.2f} s scan "
        f"({c['full_text_search_matches']}), open rollout {c['open_rollout_s']:.2f} s, "
        f"summary {c['summary_s']:.2f} s",
        f"  RSS after those {c['memory_after_interactions']['rss_mib']:.0f} MiB (peak {c['memory_after_interactions'].get('peak_rss_mib', float('nan')):.0f} MiB)",
        f"warm (cached index): URL printed {w['process_start_to_url_s']:.2f} s after start; first rows painted "
        f"{w['process_start_to_first_rows_s']:.2f} s after start "
        f"(index load {w['index_seconds']:.2f} s); RSS {w['memory_after_first_paint']['rss_mib']:.0f} MiB",
        f"rows {c['rows']:,}, malformed lines {c['malformed']}",
    ]
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
