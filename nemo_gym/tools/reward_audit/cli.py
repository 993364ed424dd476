"""``ng_reward_audit``: play an adversarial battery against environments and report what earned a reward.

Usage: ``ng_reward_audit [+env=<folder> | +env=[<folder>,...]] [+markdown_fpath=<file.md>]``. Without ``+env`` every
environment folder of the checkout is audited. Exit status: 0 every exploit scored 0 (or was refused)
and every control earned; 1 something failed; 2 bad options or a bad exploit file.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.overrides import parse_cli_overrides
from nemo_gym.config.problems import ConfigError
from nemo_gym.tools.reward_audit.play import AuditResult, run_audit
from nemo_gym.tools.reward_audit.spec import (
    EXPLOITS_FILE,
    ExploitFileError,
    environment_folders,
    load_exploit_file,
)

OPTIONS = ("env", "markdown_fpath")
USAGE = (
    "usage: ng_reward_audit [+env=<environment folder> | +env=[<folder>,...]] [+markdown_fpath=<table.md>]\n"
    "  plays the control, the generic battery and resources_servers/<env>/exploits.yaml against each\n"
    "  environment (started with the scripted model) and prints what each exploit earned.\n"
    "exit status: 0 no exploit earned or escaped and every control earned; 1 otherwise; 2 bad options/files"
)
MAX_REASON = 70


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def format_result(env: str, result: AuditResult) -> str:
    """One audit as a text table: exploit, reward, reason, verdict."""
    name = env if result.audit.name == env else f"{env} / {result.audit.name}"
    lines = [f"== {name}"]
    width = max(len(o.play.name) for o in result.outcomes)
    for o in result.outcomes:
        got = f"{o.reward:g}" if o.reward is not None else (f"HTTP {o.status}" if o.status else "no answer")
        lines.append(f"  {o.play.name:<{width}}  {got:>9}  {o.verdict:<6}  {_cut(o.reason, MAX_REASON)}")
    for server in result.servers_down:
        lines.append(f"  FAIL: server down after the battery: {server}")
    for exploit, why in sorted(result.left_out.items()):
        lines.append(f"  ({exploit}: not played: {why})")
    return "\n".join(lines)


def markdown_table(results: list[tuple[str, AuditResult]], commit: str) -> str:
    """The summary table docs/rewards.md carries: one line per audit."""
    today = datetime.date.today().isoformat()
    head = [
        f"`ng_reward_audit` over every environment, {today}, commit `{commit}`.",
        "",
        "| environment | audit | control reward | exploits played | earned a reward | not scored | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for env, r in results:
        control = next((o for o in r.outcomes if o.play.earn), None)
        played = [o for o in r.outcomes if not o.play.earn]
        earned = sum(1 for o in played if o.reward is not None and o.reward > 0)
        unscored = sum(1 for o in played if o.reward is None)
        verdict = "pass" if r.passed else "**FAIL**"
        c = f"{control.reward:g}" if control and control.reward is not None else "—"
        head.append(f"| {env} | {r.audit.name} | {c} | {len(played)} | {earned} | {unscored} | {verdict} |")
    return "\n".join(head) + "\n"


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@command("ng_reward_audit")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    try:
        options = {o.key: o.value for o in parse_cli_overrides(argv) if not o.delete}
    except ConfigError as exc:
        sys.exit(f"ng_reward_audit: {exc}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        sys.exit(f"ng_reward_audit: unknown option(s): {', '.join('+' + k for k in unknown)}\n{USAGE}")
    root = Path.cwd() if (Path.cwd() / "resources_servers").is_dir() else PACKAGE_PARENT_DIR
    folders = {f.name: f for f in environment_folders(root)}
    env_option = options.get("env") or []
    wanted = [str(e).strip() for e in (env_option if isinstance(env_option, list) else [env_option])]
    wanted = [e for e in wanted if e] or sorted(folders)
    missing = [e for e in wanted if e not in folders]
    if missing:
        sys.exit(
            f"ng_reward_audit: no environment folder {', '.join(missing)} under {root / 'resources_servers'}"
        )
    try:
        audits = {env: load_exploit_file(folders[env] / EXPLOITS_FILE) for env in wanted}
    except ExploitFileError as exc:
        sys.stderr.write(f"ng_reward_audit: {exc}\n")
        sys.exit(2)
    results: list[tuple[str, AuditResult]] = []
    for env, env_audits in audits.items():
        for audit in env_audits:
            result = run_audit(audit, folders[env], root)
            results.append((env, result))
            print(format_result(env, result), flush=True)
    failed = [f"{env}/{r.audit.name}" for env, r in results if not r.passed]
    if options.get("markdown_fpath"):
        Path(str(options["markdown_fpath"])).write_text(markdown_table(results, _commit(root)))
    print(
        f"\n{len(results)} audits: {len(results) - len(failed)} passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    sys.exit(1 if failed else 0)
