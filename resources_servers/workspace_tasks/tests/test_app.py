"""workspace_tasks against real servers (scripted model): right trajectories of every kind score 1, wrong
ones 0, the tools' errors are text the model reads, nothing leaves the workspace, the hidden tests stay
hidden, broken rows are refused; and every task's hidden tests fail on its untouched workspace and pass
after its reference solution (so each task is solvable and none passes by doing nothing).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from nemo_gym.cli import RunHelper
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.kit.text import head_tail
from nemo_gym.sandbox import SandboxSession
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    server_url,
    tagged_row,
    variant_rules,
)
from resources_servers.workspace_tasks.app import (
    HiddenTestResult,
    VerifyInfraError,
    run_hidden_tests,
    workspace_path,
)
from resources_servers.workspace_tasks.scripts.generate_dataset import EXAMPLE_TASKS
from resources_servers.workspace_tasks.scripts.generate_dataset import audit_rows as generated_audit_rows
from resources_servers.workspace_tasks.scripts.generate_dataset import example_rows as generated_examples
from resources_servers.workspace_tasks.scripts.generate_dataset import rows as generated_rows
from resources_servers.workspace_tasks.tasks import KINDS, TASKS, TASKS_BY_ID, Step, Task, build_workspace

ENV = "workspace_tasks"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = generated_rows(0)
INDEX = {row["task_id"]: i for i, row in enumerate(ROWS)}
DONE = {"text": "Done."}
# One task of each kind, solved through the tools by its reference solution.
RIGHT = ("pyfix_median", "cli_limit", "sh_top_words", "csv_people", "git_discount", "make_stats")

# Reward-gaming attempts a policy can write (tests/test_app.py::test_..._cannot_forge_...). Each leaves the
# task unsolved (the median stays wrong), and each scored 1.0 or a 503 on the runner that ran the hidden
# tests in the process that reported them.
_MEDIAN = "\ndef median(values):\n    ordered = sorted(values)\n    return ordered[len(ordered) // 2]\n"
# Prints the four pass lines (with the result token of the runner's __main__, when it finds one) on every
# stream it has, then leaves before anything else can report.
FORGED_MEDIAN = (
    """import json, os, sys
import __main__

token = getattr(__main__, "token", "")
names = getattr(__main__, "req", {}).get("tests") or ["test_odd", "test_even", "test_even_unsorted", "test_empty"]
lines = [json.dumps({"test": n, "ok": True, "error": ""}) for n in names] + [json.dumps({"done": True})]
text = "".join(token + line + "\\n" for line in lines)
for stream in (sys.__stdout__, sys.stdout, sys.__stderr__):
    try:
        stream.write(text)
        stream.flush()
    except Exception:
        pass
for fd in (1, 2, 3, 4, 5):
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
os._exit(0)
"""
    + _MEDIAN
)
# Run by top_words.sh: up its ancestors, each one's result token from /proc/PID/mem (any 16 hex digits
# between NULs after "hidden-"), then forged pass lines written to /proc/PID/fd/1 and fd/2.
PROC_FORGER = """import json, os, re

names = ["test_example", "test_other_input"]
log = open("/workspace/forge.log", "a")
pid = os.getpid()
while True:
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    if pid <= 1:
        break
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        seen = [f.read().split(b"\\0")[0].decode()]
    token = ""
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if not perms.startswith("rw"):
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(lo)
                    found = re.search(rb"\\x00hidden-[0-9a-f]{16}\\x00", mem.read(hi - lo))
                except (OSError, ValueError, OverflowError):
                    continue
                if found:
                    token = found.group().decode()
                    break
        seen.append("mem: " + ("token" if token else "read"))
    except OSError as exc:
        seen.append(f"mem: {exc.strerror}")
    lines = [json.dumps({"test": n, "ok": True, "error": ""}) for n in names] + [json.dumps({"done": True})]
    for fd in (1, 2):
        try:
            with open(f"/proc/{pid}/fd/{fd}", "w") as out:
                out.write("".join(token + line + "\\n" for line in lines))
            seen.append(f"fd {fd}: written")
        except OSError as exc:
            seen.append(f"fd {fd}: {exc.strerror}")
    print(*seen, sep="; ", file=log)
"""
# Ignores SIGALRM (the old per-test alarm) and the usual catchable signals, and never returns on 4 values.
HANGING_MEDIAN = """import signal

for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(sig, signal.SIG_IGN)


def median(values):
    ordered = sorted(values)
    while len(ordered) == 4:
        pass
    return ordered[len(ordered) // 2]
"""
# Monkeypatches what a test runner in its process would use: the error text of a failure, the name the
# hidden tests raise (AssertionError), unittest's assertions, sys.exit and os._exit; and returns a value
# equal to everything.
PATCHING_MEDIAN = """import builtins, os, sys, traceback, unittest


class _Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


class _Quiet(Exception):
    pass


_Quiet.__name__ = _Quiet.__qualname__ = ""
traceback.format_exception_only = lambda *args, **kwargs: []
builtins.AssertionError = _Quiet
for name in ("assertEqual", "assertTrue", "assertRaises", "fail"):
    setattr(unittest.TestCase, name, lambda *args, **kwargs: None)
sys.exit = os._exit = lambda *args: None


def median(values):
    return _Anything()
"""
# Kills every process it may signal (the runner, the sandbox's agent), then is the broken median.
KILLING_MEDIAN = "import os, signal\n\nos.kill(-1, signal.SIGKILL)\n" + _MEDIAN


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def _bash(command: str) -> dict[str, Any]:
    return _call("bash", command=command)


def _edit(command: str, path: str, **arguments: Any) -> dict[str, Any]:
    return _call("str_replace_based_edit_tool", command=command, path=path, **arguments)


def _solution_turns(task: Task) -> list[dict[str, Any]]:
    return [
        _edit("create", step[1], file_text=step[2]) if step[0] == "write" else _bash(step[1])
        for step in task.solution
    ]


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    task = TASKS_BY_ID[row["task_id"]]
    variants = {"right": [*_solution_turns(task), DONE], "nothing": [_bash("ls -la"), DONE]}
    if task.task_id == "pyfix_median":  # even lengths fixed, the empty list forgotten: 3 of 4 tests
        variants["partial"] = [
            _edit(
                "str_replace",
                "stats/median.py",
                old_str="    return ordered[len(ordered) // 2]",
                new_str="    mid = len(ordered) // 2\n    return ordered[mid] if len(ordered) % 2 else "
                "(ordered[mid - 1] + ordered[mid]) / 2",
            ),
            DONE,
        ]
    if task.task_id == "pyfix_median":  # reward-gaming attempts: each leaves the median wrong
        for name, text in (
            ("forged", FORGED_MEDIAN),
            ("hanging", HANGING_MEDIAN),
            ("patching", PATCHING_MEDIAN),
            ("killing", KILLING_MEDIAN),
        ):
            variants[name] = [_edit("create", "stats/median.py", file_text=text), DONE]
    if task.task_id == "sh_top_words":  # the pipeline stays broken; a script forges through /proc
        variants["proc"] = [
            _edit("create", "forge.py", file_text=PROC_FORGER),
            _bash("sed -i '3i python3 /workspace/forge.py' top_words.sh && cat top_words.sh"),
            DONE,
        ]
    if task.task_id == "pyfix_slugify":  # the editor's view / str_replace / insert, then a check
        variants["editor"] = [
            _edit("view", "/workspace"),
            _edit("view", "textutil/slug.py", view_range=[1, -1]),
            _edit(
                "str_replace",
                "/workspace/textutil/slug.py",
                old_str='return title.replace(" ", "-")',
                new_str='return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")',
            ),
            _edit("insert", "textutil/slug.py", insert_line=0, new_str="import re\n"),
            _bash("python3 -c 'from textutil.slug import slugify; print(slugify(\"  Hello, World!! \"))'"),
            DONE,
        ]
    if task.task_id == "sh_unique_ips":  # the model kills its own sandbox, then solves it in a new one
        variants["killed"] = [
            _bash("echo hi > mine.txt; kill -9 -1"),
            _bash("ls mine.txt"),
            *_solution_turns(task),
            DONE,
        ]
    if task.task_id == "cli_shout":  # solved, then the model stalls past the sandbox's idle timeout
        variants["stall"] = [*_solution_turns(task), {"delay_s": 2.5, "text": "Done."}]
    if task.task_id == "git_settings":  # the model's mistakes and escape attempts, each a tool result
        variants["mistakes"] = [
            _edit("view", "/etc/passwd"),
            _edit("create", "../escape.txt", file_text="x"),
            _bash("ln -s /etc/passwd link && ln -s / rootlink && echo linked"),
            _edit("view", "link"),
            _edit("create", "rootlink/tmp/x", file_text="x"),
            _edit("str_replace", "settings.ini", old_str="no such text", new_str="x"),
            _edit("str_replace", "settings.ini", old_str="=", new_str=":"),
            _edit("insert", "settings.ini", insert_line=99, new_str="x"),
            _edit("create", "notes.txt"),
            _edit("delete", "settings.ini"),
            {"tool_calls": [{"name": "bash", "arguments": {"cmd": "ls"}}]},
            {"tool_calls": [{"name": "bash", "arguments": "{not json"}]},
            _bash(
                "ls /; ls -a /workspace; ls /work /tmp 2>&1; echo '---'; "
                "grep -rl test_merge_committed / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr "
                "--exclude-dir=dev 2>/dev/null; echo grep-exit=$?"
            ),
            _bash("sleep 100"),
            _bash("yes | head -c 50000"),
            _bash("yes"),  # endless output: stopped at the sandbox's output cap
            _bash("sleep 60 & echo started"),
            _bash("jobs -l; ps -e -o comm= | grep -c sleep"),  # a background process dies with its command
            DONE,
        ]
    return variants


def _scripts() -> list[dict[str, Any]]:
    rules = variant_rules(ROWS, _variants)
    for row in ROWS:  # the untagged rows: the right trajectory
        task = TASKS_BY_ID[row["task_id"]]
        rules.append({"contains": task.prompt, "turns": [*_solution_turns(task), DONE]})
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        # A test past 8 s is killed (the hanging median's test_even), the whole run bounded by 60 s.
        ENV: {
            "resources_servers": {ENV: {"command_timeout_s": 6, "test_timeout_s": 8, "verify_timeout_s": 60}}
        },
    }
    with running_servers([CONFIG], extra) as h:
        yield h


@pytest.fixture(scope="module")
def idle_helper() -> Iterator[RunHelper]:
    """Servers whose sandboxes close after 1 s idle (a rollout that stalls loses its workspace)."""
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        ENV: {"resources_servers": {ENV: {"idle_timeout_s": 1}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _row(task_id: str, variant: str | None = None) -> dict[str, Any]:
    row = ROWS[INDEX[task_id]]
    return row if variant is None else tagged_row(row, variant, INDEX[task_id])


def _outputs(result: dict[str, Any]) -> list[str]:
    return [item["output"] for item in result["response"]["output"] if item["type"] == "function_call_output"]


def test_the_tasks_and_rows() -> None:
    assert len(TASKS) >= 20
    kinds = [t.kind for t in TASKS]
    assert set(kinds) == set(KINDS) and all(kinds.count(k) >= 3 for k in KINDS)
    assert generated_examples() == example_rows(ENV)  # the shipped rows are reproducible
    audit = PACKAGE_PARENT_DIR / "resources_servers" / ENV / "data" / "audit.jsonl"  # exploits.yaml's rows
    assert [orjson.loads(line) for line in audit.read_text().splitlines()] == generated_audit_rows()
    assert [r["task_id"] for r in example_rows(ENV)] == list(EXAMPLE_TASKS)
    assert generated_rows(0) == ROWS and generated_rows(1) != ROWS
    assert sorted(r["task_id"] for r in ROWS) == sorted(TASKS_BY_ID)
    for row in ROWS:  # the model never sees the hidden tests
        assert "def test_" not in orjson.dumps(row).decode()
    assert workspace_path("a/../b.txt") == "b.txt" and workspace_path("/workspace") == "."
    assert head_tail("x" * 50 + "y" * 50, 20) == "x" * 10 + "\n[... 80 characters omitted ...]\n" + "y" * 10


def test_every_task_fails_untouched_and_passes_after_its_reference_solution(tmp_path: Path) -> None:
    """One sandbox per task: the hidden tests on the built workspace (some fail), the reference solution
    applied as the tools would (a file written, a bash command), the hidden tests again (all pass)."""

    async def check(task: Task) -> tuple[int, int, int]:
        build_workspace(task, tmp_path / task.task_id)
        session = await SandboxSession.start(workspace=tmp_path / task.task_id)
        try:
            before = await run_hidden_tests(session, task, 20, 120)
            for step in task.solution:
                if step[0] == "write":
                    await session.write_file(step[1], step[2])
                else:
                    run = await session.exec(["/bin/bash", "-c", step[1]])
                    assert run.return_code == 0, (task.task_id, run.stdout, run.stderr)
            after = await run_hidden_tests(session, task, 20, 120)
        finally:
            await session.close()
        assert before.complete and after.complete, task.task_id
        assert before.failed, f"{task.task_id}: the untouched workspace passes its hidden tests"
        assert not after.failed, f"{task.task_id}: the reference solution fails {after.failed}"
        return len(before.passed), len(after.passed), after.total

    async def main() -> None:
        for task in TASKS:
            _, passed, total = await check(task)
            assert passed == total == len(task.test_names) >= 1

    asyncio.run(main())


def test_the_runner_and_its_tests_are_out_of_the_workspaces_reach(tmp_path: Path) -> None:
    """On run_hidden_tests itself: top_words.sh runs the /proc forger, which logs what it reached. The
    python3 ancestors (the test's process, the runner) and the sandbox's agent refuse their memory and fds;
    only the shells between them (whose stdout is the test's own capture) are open. And hidden tests that do
    not load are the runner not starting, infrastructure: VerifyInfraError (a 503), never a 0."""
    task = TASKS_BY_ID["sh_top_words"]
    build_workspace(task, tmp_path / task.task_id)

    async def main() -> tuple[HiddenTestResult, str]:
        session = await SandboxSession.start(workspace=tmp_path / task.task_id)
        try:
            await session.write_file("forge.py", PROC_FORGER)
            run = await session.exec(["sed", "-i", "3i python3 /workspace/forge.py", "top_words.sh"])
            assert run.return_code == 0, run.stderr
            result = await run_hidden_tests(session, task, 20, 60)
            log = (await session.read_file("forge.log")).decode()
            broken = dataclasses.replace(
                task, hidden_tests=task.hidden_tests + "\nraise ImportError('oops')\n"
            )
            with pytest.raises(
                VerifyInfraError, match="(?s)did not start: the hidden tests do not load: .*ImportError: oops"
            ):
                await run_hidden_tests(session, broken, 20, 60)
        finally:
            await session.close()
        return result, log

    result, log = asyncio.run(main())
    assert result.complete and result.passed == [] and set(result.failed) == set(task.test_names)
    assert result.failure_reason == "2 of 2 hidden tests failed"
    lines = log.splitlines()
    # Per test: sh top_words.sh, sh -c, the test's process, the runner, the sandbox's agent.
    assert len(lines) >= 2 * 4, log
    for line in lines:
        name = line.split(";")[0]
        if "python3" in name:
            assert line.endswith(
                "mem: Permission denied; fd 1: Permission denied; fd 2: Permission denied"
            ), line
        else:
            assert name in ("/bin/sh", "sh") and "mem: read; fd 1: written; fd 2: written" in line, line
    assert sum("python3" in line for line in lines) >= 3 * 2, log


# Right medians whose values are not plain ints and floats (they compared equal in the runner's process
# before calls ran in their own), and a float whose __eq__ lies: only its real value counts.
OTHER_MEDIANS = {
    "fraction": "from fractions import Fraction\n\n\ndef median(v):\n    if not v:\n        raise ValueError('empty')\n"
    "    o = sorted(v)\n    m = len(o) // 2\n    return o[m] if len(o) % 2 else Fraction(o[m - 1] + o[m], 2)\n",
    "numpy": "import numpy\n\n\ndef median(v):\n    if not v:\n        raise ValueError('empty')\n"
    "    return numpy.median(numpy.array(v))\n",
    "decimal, a ValueError subclass": "import decimal\n\n\nclass Empty(ValueError):\n    pass\n\n\n"
    "def median(v):\n    if not v:\n        raise Empty('empty')\n    o = sorted(v)\n    m = len(o) // 2\n"
    "    return decimal.Decimal(o[m]) if len(o) % 2 else decimal.Decimal(o[m - 1] + o[m]) / 2\n",
    "lying float": "class Yes(float):\n    def __eq__(self, other):\n        return True\n\n"
    "    __hash__ = float.__hash__\n\n\ndef median(v):\n    if not v:\n        raise ValueError('empty')\n"
    "    return Yes(sorted(v)[len(v) // 2])\n",
}


def test_a_call_hands_back_plain_values(tmp_path: Path) -> None:
    """load(...).f(...) runs in its own process: a Fraction, numpy or Decimal median and a ValueError
    subclass still pass (as they did when the module was imported into the runner); a float subclass
    that says it equals everything is compared by its value, and fails where that value is wrong."""
    task = TASKS_BY_ID["pyfix_median"]
    build_workspace(task, tmp_path / task.task_id)

    async def main() -> dict[str, HiddenTestResult]:
        session = await SandboxSession.start(workspace=tmp_path / task.task_id)
        results = {}
        try:
            for name, text in OTHER_MEDIANS.items():
                await session.write_file("stats/median.py", text)
                results[name] = await run_hidden_tests(session, task, 20, 60)
        finally:
            await session.close()
        return results

    results = asyncio.run(main())
    for name in ("fraction", "numpy", "decimal, a ValueError subclass"):
        assert results[name].passed == task.test_names, (name, results[name].failed)
    assert results["lying float"].failed == {
        "test_even": "AssertionError",
        "test_even_unsorted": "AssertionError",
    }


# Answers written otherwise than the reference solutions: the right ones must pass, and the ones that spot
# the hidden tests' probe instead of doing the task (a `make test` that fails only on the calc.py the old
# test wrote, a `stats` that knows the file the old test added, ...) must fail, with the tests named. The
# hidden tests make up their inputs at every run (a unit test planted in tests/, a data file or note of a
# random name, a second log), so only the behaviour the prompt asks for passes them.
_MAKE_TEST = "run:\n\tpython3 calc.py\n\n"
OTHER_ANSWERS: dict[str, dict[str, tuple[list[Step], set[str]]]] = {
    "make_test": {
        "verbose, a phony target": (
            [
                (
                    "write",
                    "Makefile",
                    _MAKE_TEST + ".PHONY: test\ntest:\n\tpython3 -m unittest discover -v -s tests\n",
                )
            ],
            set(),
        ),
        "prints 'Ran 1 test' and fails when calc.py holds `a - b`": (
            [
                (
                    "write",
                    "Makefile",
                    _MAKE_TEST
                    + "test:\n\t@if grep -q 'a - b' calc.py; then exit 1; fi; echo 'Ran 1 test' >&2\n",
                )
            ],
            {"test_passes", "test_fails_when_a_test_fails", "test_fails_when_calc_breaks"},
        ),
        "runs the tests, then passes iff calc.py is unchanged": (
            [
                (
                    "bash",
                    'printf \'test:\\n\\t-python3 -m unittest discover -s tests\\n\\t[ "$$(cksum < calc.py)" = "%s" ]\\n\' '
                    '"$(cksum < calc.py)" >> Makefile',
                )
            ],
            {"test_passes", "test_fails_when_a_test_fails"},
        ),
        "runs the tests, ignores their failures": (
            [("bash", "printf '\\ntest:\\n\\t-python3 -m unittest discover -s tests\\n' >> Makefile")],
            {"test_fails_when_a_test_fails", "test_fails_when_calc_breaks"},
        ),
    },
    "make_stats": {
        "awk counts the records": (
            [
                (
                    "write",
                    "Makefile",
                    ".PHONY: all\nall:\n\t@echo ok\n\nstats:\n\t@awk 'END { print \"total: \" NR }' data/*.txt\n",
                )
            ],
            set(),
        ),
        "knows the file the old test added": (
            [
                (
                    "bash",
                    'printf \'\\nstats:\\n\\t@if [ -f data/z.txt ]; then echo "total: 7"; else echo "total: 5"; fi\\n\' >> Makefile',
                )
            ],
            {"test_stats_not_echoed_and_follows_data"},
        ),
    },
    "make_dist": {
        "tar -C of the directory": (
            [
                (
                    "bash",
                    "printf '\\ndist:\\n\\t@mkdir -p dist && tar -C . -czf dist/notes.tar.gz notes/\\n' >> Makefile",
                )
            ],
            set(),
        ),
        "archives the notes it sees, not the directory": (
            [
                (
                    "bash",
                    "printf '\\ndist:\\n\\tmkdir -p dist\\n\\ttar czf dist/notes.tar.gz notes/one.md notes/two.md\\n' >> Makefile",
                )
            ],
            {"test_dist_follows_the_directory"},
        ),
    },
    "make_clean": {
        "removes the sources too": (
            [("bash", "printf '\\nclean:\\n\\trm -rf build src\\n' >> Makefile")],
            {"test_build_then_clean"},
        ),
    },
    "sh_count_errors": {
        "grep of the second field": (
            [("write", "errors.sh", "#!/bin/sh\ngrep -c '^[^ ]* ERROR ' \"$1\"\n")],
            set(),
        ),
        "2 for app.log, 0 for anything else": (
            [("write", "errors.sh", '#!/bin/sh\ncase "$1" in app.log) echo 2 ;; *) echo 0 ;; esac\n')],
            {"test_other_log"},
        ),
    },
    "sh_unique_ips": {
        "sort | uniq": ([("bash", "sed -i 's/| uniq |/| sort | uniq |/' unique_ips.sh")], set()),
        "4 for access.log, 2 for anything else": (
            [("write", "unique_ips.sh", '#!/bin/sh\ncase "$1" in access.log) echo 4 ;; *) echo 2 ;; esac\n')],
            {"test_interleaved"},
        ),
    },
    "git_settings": {
        "the conflicted file committed, the fix hidden by assume-unchanged": (
            [
                ("bash", "git add settings.ini && git commit -q --no-edit"),
                ("write", "settings.ini", "[server]\nport = 8080\ntimeout = 30\nretries = 5\n"),
                ("bash", "git update-index --assume-unchanged settings.ini"),
            ],
            {"test_merge_committed"},
        ),
    },
    "git_authors": {
        "edited with str_replace-like steps, committed with -a": (
            [
                ("write", "AUTHORS", "Ada\nBarbara\nGrace\nKatherine\nLinus\n"),
                ("bash", "git commit -qam 'merge feature'"),
            ],
            set(),
        ),
        "no merge: one parent, a replace ref grafts a second": (
            [
                ("bash", "git merge --abort"),
                ("write", "AUTHORS", "Ada\nBarbara\nGrace\nKatherine\nLinus\n"),
                ("bash", "git commit -qam authors && git replace --graft HEAD HEAD~1 feature"),
            ],
            {"test_merge_committed"},
        ),
    },
}


def test_answers_written_otherwise_and_probe_spotters(tmp_path: Path) -> None:
    async def apply(session: SandboxSession, steps: list[Step]) -> None:
        for step in steps:
            if step[0] == "write":
                await session.write_file(step[1], step[2])
            else:
                run = await session.exec(["/bin/bash", "-c", step[1]])
                assert run.return_code == 0, (step, run.stdout, run.stderr)

    async def main() -> dict[tuple[str, str], dict[str, str]]:
        failed = {}
        for task_id, answers in OTHER_ANSWERS.items():
            task = TASKS_BY_ID[task_id]
            build_workspace(task, tmp_path / task_id)
            session = await SandboxSession.start(workspace=tmp_path / task_id)
            try:
                untouched = await session.snapshot()
                for name, (steps, _) in answers.items():
                    await session.restore(untouched)
                    await apply(session, steps)
                    result = await run_hidden_tests(session, task, 20, 120)
                    assert result.complete, (task_id, name, result.failure_reason)
                    failed[task_id, name] = result.failed
            finally:
                await session.close()
        return failed

    failed = asyncio.run(main())
    for task_id, answers in OTHER_ANSWERS.items():
        for name, (_, expected) in answers.items():
            assert set(failed[task_id, name]) == expected, (task_id, name, failed[task_id, name])


def test_right_trajectories_of_every_kind_score_one(helper: RunHelper) -> None:
    assert {TASKS_BY_ID[t].kind for t in RIGHT} == set(KINDS)
    for task_id in RIGHT:
        result = run_rollout(helper, AGENT, _row(task_id), timeout=120)
        assert result["reward"] == 1.0, (task_id, result["failed_tests"], _outputs(result))
        assert result["tests_passed"] == 1.0 and result["passed_count"] == result["test_count"] > 0
        assert result["failed_tests"] == {} and result["kind"] == TASKS_BY_ID[task_id].kind
    result = run_rollout(helper, AGENT, _row("pyfix_slugify", "editor"), timeout=120)
    outputs = [orjson.loads(o) for o in _outputs(result)]
    assert (
        "/workspace/textutil/slug.py" in outputs[0]["output"]
        and "     1\tdef slugify" in outputs[1]["output"]
    )
    assert not any(o.get("is_error") for o in outputs[:4]), outputs
    assert outputs[4] == {"output": "hello-world\n", "exit_code": 0, "timed_out": False}
    assert result["reward"] == 1.0 and result["edits_made"] == 2 and result["commands_run"] == 1


def test_wrong_trajectories_score_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("pyfix_median", "partial"), timeout=120)
    assert result["reward"] == 0.0 and result["tests_passed"] == 0.75
    assert (
        list(result["failed_tests"]) == ["test_empty"]
        and "IndexError" in result["failed_tests"]["test_empty"]
    )
    for task_id in ("git_settings", "make_clean", "csv_emails"):
        result = run_rollout(helper, AGENT, _row(task_id, "nothing"), timeout=120)
        assert result["reward"] == 0.0 and result["tests_passed"] < 1.0, task_id


def _verified(helper: RunHelper, task_id: str, variant: str) -> dict[str, Any]:
    """One rollout through the agent; its /verify must answer 200 (a 503 would be the model's doing
    passed off as infrastructure)."""
    resp = post_json(server_url(helper, AGENT) + "/run", _row(task_id, variant), timeout=180)
    assert resp.status_code == 200, f"/run answered {resp.status_code}: {resp.text[:2000]}"
    return resp.json()


def test_workspace_code_cannot_forge_results_from_the_runners_process(helper: RunHelper) -> None:
    """A broken stats/median.py that, when imported, prints pass lines with the token it finds in the
    runner's __main__ (on stdout, stderr, fds 1-5) and leaves with os._exit(0): every test fails."""
    result = _verified(helper, "pyfix_median", "forged")
    assert result["reward"] == 0.0 and result["passed_count"] == 0, result["failed_tests"]
    assert set(result["failed_tests"]) == {"test_odd", "test_even", "test_even_unsorted", "test_empty"}
    # What it wrote reached only its own call's answer (as if median returned it), which is no value.
    for name, reason in result["failed_tests"].items():
        assert (
            reason.startswith("RuntimeError: the call stats.median.median(")
            and "not a Python literal" in reason
        ), (
            name,
            reason,
        )
    assert result["failure_reason"] == "4 of 4 hidden tests failed"


def test_a_shell_script_cannot_forge_results_through_proc(helper: RunHelper) -> None:
    """top_words.sh (run by the hidden tests through sh()) runs a script that reads each ancestor's memory
    for the result token and writes pass lines to its /proc/PID/fd/1 and fd/2: nothing it writes counts."""
    result = _verified(helper, "sh_top_words", "proc")
    assert orjson.loads(_outputs(result)[1])["exit_code"] == 0
    assert result["reward"] == 0.0 and result["passed_count"] == 0, result["failed_tests"]
    assert set(result["failed_tests"]) == {"test_example", "test_other_input"}
    assert all(reason.startswith("AssertionError") for reason in result["failed_tests"].values())


def test_a_hanging_test_is_killed_from_outside_and_fails(helper: RunHelper) -> None:
    """median() loops forever on four values and ignores SIGALRM and the usual catchable signals: that
    test is killed at test_timeout_s (8 s here) and fails; the others run; reward 0, not a 503."""
    result = _verified(helper, "pyfix_median", "hanging")
    assert result["reward"] == 0.0 and result["passed_count"] == 1, result["failed_tests"]
    assert result["failed_tests"] == {
        "test_even": "the test took longer than 8 s: killed",
        "test_even_unsorted": "AssertionError",
        "test_empty": "IndexError: list index out of range",
    }
    assert result["failure_reason"] == "3 of 4 hidden tests failed"


def test_monkeypatching_the_runner_changes_nothing(helper: RunHelper) -> None:
    """median.py patches traceback, builtins.AssertionError, unittest, sys.exit and os._exit, and returns
    an object equal to everything: the hidden tests compare plain values outside its process."""
    result = _verified(helper, "pyfix_median", "patching")
    assert result["reward"] == 0.0 and result["passed_count"] == 0, result["failed_tests"]
    assert all(
        "_Anything object" in r and "not a Python literal" in r for r in result["failed_tests"].values()
    )


def test_killing_the_runner_and_the_sandbox_is_a_zero_not_a_503(helper: RunHelper) -> None:
    """median.py kills every process it may signal (kill -9 -1: the runner and the sandbox's agent with it)
    when imported: the model's doing, so reward 0 with the reason, not infrastructure."""
    result = _verified(helper, "pyfix_median", "killing")
    assert result["reward"] == 0.0 and result["passed_count"] == 0, result["failed_tests"]
    assert "the sandbox died while the hidden tests ran" in result["failure_reason"]
    assert set(result["failed_tests"].values()) == {f"not run: {result['failure_reason']}"}


def test_tool_mistakes_and_escapes_are_tool_errors_and_hidden_tests_stay_hidden(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("git_settings", "mistakes"), timeout=120)
    out = _outputs(result)
    edits = {i: orjson.loads(out[i]) for i in (0, 1, 3, 4, 5, 6, 7, 8)}
    assert all(e["is_error"] for e in edits.values()), edits
    assert "'/etc/passwd' is outside /workspace" in edits[0]["output"]
    assert "'../escape.txt' is outside /workspace" in edits[1]["output"]
    assert orjson.loads(out[2])["output"] == "linked\n"
    assert edits[3]["output"].startswith(
        "Error: cannot read /workspace/link"
    )  # a symlink out is not followed
    assert "ValueError" not in edits[3]["output"]
    assert edits[4]["output"].startswith("Error: cannot write /workspace/rootlink/tmp/x")
    assert "did not appear verbatim" in edits[5]["output"]
    assert "Multiple occurrences" in edits[6]["output"] and "lines [2, 4, 5, 6, 7]" in edits[6]["output"]
    assert "lines of the file: [0, 8]" in edits[7]["output"]
    assert "`file_text` is required" in edits[8]["output"]
    assert (
        out[9].startswith("Error: invalid arguments for tool 'str_replace_based_edit_tool'")
        and "command" in out[9]
    )
    assert out[10].startswith("Error: invalid arguments for tool 'bash'") and "command" in out[10]
    assert out[11].startswith("Error: the arguments for tool 'bash' are not valid JSON")
    listing = orjson.loads(out[12])["output"]
    assert "settings.ini" in listing and ".git" in listing and "No such file or directory" in listing
    assert listing.rstrip().endswith("grep-exit=1")  # nothing outside /proc, /sys, /usr, /dev holds the tests
    assert "test_" not in listing.split("---")[1]
    slow = orjson.loads(out[13])
    assert slow["timed_out"] is True and slow["exit_code"] is None and "killed" in slow["output"]
    loud = orjson.loads(out[14])
    assert loud["exit_code"] == 0 and "characters omitted" in loud["output"] and len(loud["output"]) < 10_200
    endless = orjson.loads(out[15])
    assert "characters omitted" in endless["output"] and "[output truncated" in endless["output"]
    assert len(endless["output"]) < 10_200
    assert orjson.loads(out[16])["output"] == "started\n"
    assert orjson.loads(out[17])["output"].strip() == "0"
    assert result["reward"] == 0.0  # nothing was resolved; the escapes changed nothing outside


def test_broken_rows_are_refused_before_any_rollout(helper: RunHelper, tmp_path: Path) -> None:
    url = server_url(helper, ENV)
    missing = {k: v for k, v in ROWS[0].items() if k != "task_id"}
    resp = post_json(url + "/seed_session", missing)
    assert resp.status_code == 422 and "task_id" in resp.text
    unknown = {**copy.deepcopy(ROWS[0]), "task_id": "no_such_task"}
    resp = post_json(url + "/verify", {**unknown, "response": {"output": []}})
    assert resp.status_code == 422 and "unknown task_id 'no_such_task'" in resp.text
    resp = post_json(url + "/bash", {"command": "ls"})  # a tool before /seed_session: a readable 400
    assert resp.status_code == 400 and "/seed_session" in resp.text

    # ng_collect_rollouts: a row without the task field stops the run before anything is sent ...
    code, out, err = collect_rollouts(helper, [_row("cli_shout"), missing], tmp_path / "a", AGENT)
    assert code != 0 and out == [] and "input.jsonl:2: missing field `task_id`" in err, err[-2000:]
    # ... and a row naming no task is scored by no one: 422 at /seed_session, in the failures sidecar.
    rows = [_row("cli_shout"), _row("cli_shout", "nothing"), unknown]
    code, out, err = collect_rollouts(helper, rows, tmp_path / "b", AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0, 0.0], err[-2000:]
    assert code == 1
    lines = (tmp_path / "b" / "output_failures.jsonl").read_text().splitlines()
    failures = [orjson.loads(line) for line in lines]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 2
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "unknown task_id" in failures[0]["error"]


def test_a_sandbox_killed_by_its_command_is_reported_and_replaced(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("sh_unique_ips", "killed"), timeout=120)
    killed, listing = (orjson.loads(o) for o in _outputs(result)[:2])
    assert killed["exit_code"] is None and "the sandbox died under this command" in killed["output"]
    assert "No such file" in listing["output"] and listing["exit_code"] == 2  # a fresh workspace
    assert result["reward"] == 1.0


def test_a_lost_workspace_is_a_503_in_the_failures_sidecar_not_a_zero(
    idle_helper: RunHelper, tmp_path: Path
) -> None:
    """The rollout's sandbox closed at its idle timeout before /verify: its workspace is gone, so there
    is nothing to score (a 503, filed as a failure), never a reward computed on the untouched task."""
    rows = [_row("cli_shout"), _row("cli_shout", "stall")]
    code, out, err = collect_rollouts(idle_helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0], err[-2000:]
    assert code == 1
    lines = (tmp_path / "output_failures.jsonl").read_text().splitlines()
    failures = [orjson.loads(line) for line in lines]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 1
    assert (failures[0]["path"], failures[0]["status"]) == ("/verify", 503)
    assert "workspace was lost" in failures[0]["error"] and "idle for 1 s" in failures[0]["error"]


def test_verify_and_end_session_close_the_rollouts_sandbox(helper: RunHelper) -> None:
    url = server_url(helper, ENV)
    row = _row("sh_unique_ips")
    for end in ("/verify", "/end_session"):
        cookies = dict(post_json(url + "/seed_session", row).cookies)
        fixed = post_json(
            url + "/bash", {"command": "sed -i 's/| uniq |/| sort -u |/' unique_ips.sh"}, cookies
        )
        assert fixed.json()["exit_code"] == 0
        body = {**row, "response": {"output": []}} if end == "/verify" else {}
        resp = post_json(url + end, body, cookies, timeout=120)
        assert resp.status_code == 200, resp.text
        if end == "/verify":  # the fork saw the rollout's own edit
            assert resp.json()["reward"] == 1.0 and resp.json()["commands_run"] == 1
        after = post_json(url + "/bash", {"command": "ls"}, cookies)
        assert after.status_code == 400 and "/seed_session" in after.text  # the rollout is gone


def test_an_agents_own_sandbox_gets_the_workspace_and_its_changes_are_judged(
    helper: RunHelper, tmp_path: Path
) -> None:
    """What harness_agent (workspace: resources_server) does, in this process: the task's workspace from
    /export_workspace (never the hidden tests), the fix made in a sandbox of its own, the changeset in the
    /verify body. Applied to the rollout's workspace, judged by the hidden tests in a fork: 1; not echoed.
    A changeset that is not base64, or not a tar, is the caller's mistake: 422, never a score."""
    url = server_url(helper, ENV)
    row = _row("git_settings")
    task = TASKS_BY_ID["git_settings"]
    cookies = dict(post_json(url + "/seed_session", row).cookies)
    exported = post_json(url + "/export_workspace", {}, cookies)
    assert exported.status_code == 200, exported.text
    data = base64.b64decode(exported.json()["tar_base64"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        assert "settings.ini" in names and ".git/MERGE_HEAD" in names
        blob = b"".join(tar.extractfile(m).read() for m in tar if m.isreg())  # type: ignore[union-attr]
    assert all(name.encode() not in blob for name in task.test_names)  # the hidden tests are not in it
    (tmp_path / "workspace.tar").write_bytes(data)

    async def solve_elsewhere() -> bytes:
        session = await SandboxSession.start(workspace=tmp_path / "workspace.tar")
        try:
            for step in task.solution:
                if step[0] == "write":
                    await session.write_file(step[1], step[2])
                else:
                    assert (await session.exec(step[1])).return_code == 0
            return await session.export_changes(max_bytes=1 << 20)
        finally:
            await session.close()

    changes = base64.b64encode(asyncio.run(solve_elsewhere())).decode()
    resp = post_json(
        url + "/verify", {**row, "response": {"output": []}, "workspace_changes": changes}, cookies
    )
    assert resp.status_code == 200, resp.text
    verdict = resp.json()
    assert (verdict["reward"], verdict["failure_reason"], verdict["commands_run"]) == (1.0, None, 0), verdict
    assert verdict.get("workspace_changes") is None

    for bad, said in (
        ("%%%", "not base64"),
        (base64.b64encode(b"not a tar").decode(), "not a changeset tar"),
    ):
        cookies = dict(post_json(url + "/seed_session", row).cookies)
        resp = post_json(
            url + "/verify", {**row, "response": {"output": []}, "workspace_changes": bad}, cookies
        )
        assert resp.status_code == 422 and said in resp.text, resp.text


def test_the_dry_run_config_plays_each_example_rows_reference_solution() -> None:
    """The README's dry run (no model) plays the same turns as the right trajectories scored 1 above."""
    path = (
        PACKAGE_PARENT_DIR / "responses_api_models/scripted_model/configs/scripted_model_workspace_tasks.yaml"
    )
    rules = yaml.safe_load(path.read_text())["policy_model"]["responses_api_models"]["scripted_model"]
    examples = [row["task_id"] for row in generated_examples()]
    assert len(rules["scripts_by_input"]) == len(examples) == 5
    for rule, task_id in zip(rules["scripts_by_input"], examples, strict=True):
        task = TASKS_BY_ID[task_id]
        assert rule["contains"] == task.prompt, task_id
        assert rule["turns"] == [*_solution_turns(task), DONE], task_id
