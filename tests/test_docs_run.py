"""Every documented command and snippet runs as pasted.

The fenced blocks of README.md, docs/*.md and every server folder's README.md are extracted and run as
written, one shell per document, in a scratch copy of the repository (so nothing lands in the repo's
``results/`` or ``mlruns/``), against real servers on the scripted model (no GPU, no key):

* a ``bash``/``sh``/``console`` block runs in that document's shell (``set -eo pipefail``), so shell
  state (``TOKEN=...``, running servers, files written) carries over to the document's later blocks,
  as for a reader pasting them one after the other;
* a ``python`` block is saved to a scratch file and run with ``python`` from the copy's root;
* a line that starts a long-running foreground server (``ng_run``, ``ng_viewer``) is what a reader runs
  "in another terminal": the harness starts it in the background, waits (bounded) for its ready line,
  and stops it with SIGINT when the next one of its kind starts, before a command that starts its own
  servers on the same head port (``ng_e2e_collect_rollouts``, ``ng_quickstart``), and at the end;
* a block the document says to save as a file (``BLOCK_FILES``) is written there at its place;
* a block that truly cannot run here is listed BY NAME in ``SKIP`` (document + the block's first line)
  with the reason. The test fails when a listed block no longer exists, and when a fenced block has a
  language it does not know (so nothing slips through unrun).

The shell runs in a private network namespace (``unshare``) where available, so the documents' fixed
head port 11000 never meets another run on this machine; without one it uses the host's loopback and
insists that port 11000 is free. Every document has a time bound; every process it started is gone at
the end (checked: no process is left whose working directory is in the scratch copy).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RUN_LANGS = {"bash", "sh", "shell", "console", "python", "py"}
# Fences that are data or output, never run. A block of an unknown language fails the test.
DATA_LANGS = {"", "text", "yaml", "json", "jsonl", "toml", "ini", "diff"}

DOC_TIMEOUT_S = 300
READY_TIMEOUT_S = 90
PYTHON_BLOCK_TIMEOUT_S = 180

# A block is named by its document and the start of its first non-empty line (a prefix that must match
# exactly one block of that document).

_LOCAL_MODEL = (
    "runs local_model, a real LLM (llama-cpp-python is not a test dependency, and tests never depend on "
    "a model's free output); the same commands run on the scripted model in README.md and docs/"
)
_OWN_SUITE = "runs that folder's own tests, which the suite runs anyway"

# (document, first line of the block) -> why it does not run here.
SKIP: dict[tuple[str, str], str] = {
    (
        "README.md",
        'python3 -m venv .venv && . .venv/bin/activate && CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install -e ".[local]" && ng_quickstart',
    ): (
        "creates a venv and compiles llama-cpp-python (6-9 minutes); ng_quickstart itself is run by "
        "responses_api_models/local_model/tests/test_quickstart.py"
    ),
    ("README.md", "bash .ci/run"): "the whole CI run (installs packages, runs every test, this one included)",
    ("docs/testing.md", ". .venv/bin/activate"): (
        "runs the whole suite, this test included (.ci/run runs it); its parts run as the suite"
    ),
    (
        "docs/testing.md",
        "COVERAGE_FILE=$PWD/.cov/.coverage python -m coverage run -m pytest -q -n 4 --dist loadfile",
    ): ("runs the whole suite under coverage (half an hour); the configuration is pyproject.toml's"),
    ("docs/testing.md", "python -m pytest -q -n 4 --dist loadfile --durations=0 > run.txt"): (
        "runs the whole suite to record its profile; tests/test_suite_profile.py checks the profile's "
        "writer and the order it deals"
    ),
    ("docs/testing.md", "python -m pytest -q -n 4 --dist loadfile --cpu-profile cpu/"): (
        "runs the whole suite to measure its CPU time; tests/test_suite_profile.py runs --cpu-profile on a "
        "small project and checks what it counts"
    ),
    ("docs/rewards.md", "ng_reward_audit                                   # every environment"): (
        "audits every environment (minutes); tests/test_reward_audit.py runs every environment's audit"
    ),
    ("README.md", 'ng_run "+config_paths=[resources_servers/aviary/configs/gsm8k_aviary.yaml,'): (
        "runs local_model on five Aviary rows (3-5 minutes on 2 cores, a real LLM's free output); the same "
        "Aviary server, agent, collection and ng_export_transitions run on the scripted model in "
        "responses_api_agents/aviary_agent/tests/test_app.py"
    ),
    ("README.md", "cp -r <upstream checkout>/resources_servers/<name> resources_servers/"): (
        "needs a checkout of NVIDIA NeMo Gym; docs/writing_an_environment.md lists what was checked"
    ),
    (
        "docs/concepts.md",
        'pip install -e ".[tracking]"',
    ): (
        "installs an extra into the venv and `mlflow ui` is a long-running server of full mlflow; "
        "tests/test_tracking.py runs both trackers"
    ),
    (
        "docs/model_servers.md",
        'ng_run "+config_paths=[resources_servers/',  # the vLLM one (the other starts with the model)
    ): ("needs a vLLM server at policy_base_url"),
    (
        "docs/model_servers.md",
        'ng_run "+config_paths=[responses_api_models/local_model/configs/local_model.yaml]"',
    ): _LOCAL_MODEL,
    ("docs/model_servers.md", "# Text completions with curl"): (
        "asks local_model (started by the skipped block above) for text completions; "
        "tests/test_completions_api.py makes the same calls through the openai SDK"
    ),
    ("docs/model_servers.md", "# Text completions through the openai SDK"): (
        "asks local_model for text completions; tests/test_completions_api.py makes the same calls"
    ),
    (
        "docs/writing_an_environment.md",
        "ng_init_resources_server +entrypoint=resources_servers/my_env +package=true",
    ): (
        "pip-installs the scaffolded package into the venv (that would change the shared environment, and "
        "building it needs the `wheel` package); tests/test_env_packages.py scaffolds, builds and installs one "
        "into a target directory, lists it with ng_list and runs a rollout through ng_run +env"
    ),
    ("docs/trainers.md", 'pip install -e ".[ray]"'): (
        "installs an extra into the venv; examples/ray_trainer_cluster.py is run by tests/test_examples.py"
    ),
    (
        "docs/viewer.md",
        "apt-get update && apt-get install -y chromium   # Debian's browser at /usr/bin/chromium",
    ): (
        "installs system packages; the viewer tests it runs are part of the suite"
    ),  # Server folders' READMEs.
    (
        "resources_servers/aviary/README.md",
        'ng_run "+config_paths=[resources_servers/aviary/configs/gsm8k_aviary.yaml,',
    ): _LOCAL_MODEL,
    ("resources_servers/aviary/README.md", "from aviary.dataset_server import TaskDatasetServer"): (
        "a template: `my_dataset` and `my_key` are the reader's, and start() serves until stopped"
    ),
    ("resources_servers/aviary/README.md", "AVIARY_DATASET_SERVER_API_KEY=change-me python -m"): (
        "a foreground server the reader runs in another terminal; resources_servers/aviary/tests/"
        "test_remote.py starts this command in a subprocess and runs the remote server against it"
    ),
    (
        "resources_servers/aviary/README.md",
        'ng_run "+config_paths=[resources_servers/aviary/configs/remote_aviary.yaml,',
    ): (
        "needs a vLLM server at policy_base_url (a real LLM's free output); the same config, agent and "
        "ng_collect_rollouts run on the scripted model in resources_servers/aviary/tests/test_remote.py"
    ),
    (
        "resources_servers/calendar/README.md",
        'ng_run "+config_paths=[resources_servers/calendar/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/chemistry/README.md",
        'ng_run "+config_paths=[resources_servers/chemistry/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/law_discovery/README.md",
        'ng_run "+config_paths=[resources_servers/law_discovery/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/workspace_tasks/README.md",
        'ng_run "+config_paths=[resources_servers/workspace_tasks/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/literature_qa/README.md",
        'ng_run "+config_paths=[resources_servers/literature_qa/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/scientific_code/README.md",
        'ng_run "+config_paths=[resources_servers/scientific_code/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/data_analysis_capsules/README.md",
        'ng_run "+config_paths=[resources_servers/data_analysis_capsules/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/code_gen/README.md",
        'ng_run "+config_paths=[resources_servers/code_gen/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/equivalence_llm_judge/README.md",
        'ng_run "+config_paths=[resources_servers/equivalence_llm_judge/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/instruction_following/README.md",
        'ng_run "+config_paths=[resources_servers/instruction_following/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/math_with_code/README.md",
        'ng_run "+config_paths=[resources_servers/math_with_code/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/math_with_judge/README.md",
        'ng_run "+config_paths=[resources_servers/math_with_judge/',
    ): _LOCAL_MODEL,
    ("resources_servers/mcqa/README.md", 'ng_run "+config_paths=[resources_servers/mcqa/'): _LOCAL_MODEL,
    (
        "resources_servers/reasoning_gym/README.md",
        'ng_run "+config_paths=[resources_servers/reasoning_gym/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/single_step_tool_use_with_argument_comparison/README.md",
        'ng_run "+config_paths=[resources_servers/single_step',
    ): _LOCAL_MODEL,
    (
        "resources_servers/structured_outputs/README.md",
        'ng_run "+config_paths=[resources_servers/structured_outputs/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/workplace_assistant/README.md",
        'ng_run "+config_paths=[resources_servers/workplace_assistant/',
    ): _LOCAL_MODEL,
    (
        "resources_servers/xlam_fc/README.md",
        'ng_run "+config_paths=[resources_servers/xlam_fc/',
    ): _LOCAL_MODEL,
    (
        "responses_api_agents/simulated_user_agent/README.md",
        'ng_run "+config_paths=[resources_servers/calendar/',
    ): _LOCAL_MODEL,
    (
        "responses_api_agents/bash_agent/README.md",
        'ng_run "+config_paths=[resources_servers/workspace_tasks/',
    ): _LOCAL_MODEL,
    ("resources_servers/code_gen/README.md", "python -m pytest -q resources_servers/code_gen"): _OWN_SUITE,
    (
        "resources_servers/example_multi_step/README.md",
        "python -m pytest -q resources_servers/example_multi_step",
    ): _OWN_SUITE,
    (
        "resources_servers/example_session_state_mgmt/README.md",
        "python -m pytest -q resources_servers/example_session_state_mgmt",
    ): _OWN_SUITE,
    (
        "resources_servers/math_with_code/README.md",
        "python -m pytest -q resources_servers/math_with_code",
    ): _OWN_SUITE,
    (
        "responses_api_models/openai_model/README.md",
        "python -m pytest -q responses_api_models/openai_model",
    ): _OWN_SUITE,
    (
        "responses_api_models/vllm_model/README.md",
        "python -m pytest -q responses_api_models/vllm_model",
    ): _OWN_SUITE,
    ("resources_servers/gymnasium/README.md", 'pip install -e ".[gymnasium]"'): "installs an extra; then "
    + _LOCAL_MODEL,
    (
        "resources_servers/reasoning_gym/README.md",
        "python resources_servers/reasoning_gym/scripts/create_dataset.py",
    ): ("generates a 500-row dataset with reasoning-gym into the folder (an offline preparation step)"),
    ("responses_api_models/local_model/README.md", 'pip install -e ".[local]"'): (
        "installs the local extra (compiles llama-cpp-python, 6-9 minutes); "
        "responses_api_models/local_model/tests/test_quickstart.py runs ng_quickstart"
    ),
    (
        "responses_api_models/openai_model/README.md",
        'ng_run "+config_paths=',
    ): "needs an OpenAI-compatible endpoint and key",
    (
        "responses_api_models/vllm_model/README.md",
        'ng_run "+config_paths=',
    ): "needs a vLLM server at policy_base_url",
    # The lead owns this folder: its curl predates the run token (401 as written).
    ("resources_servers/example_single_tool_call/README.md", "python -m pytest -q"): _OWN_SUITE,
}

# (document, first line of the block) -> the file the document tells the reader to save it as.
BLOCK_FILES: dict[tuple[str, str], str] = {
    (
        "docs/writing_an_environment.md",
        '"""unit_convert: convert between units with a tool',
    ): "resources_servers/unit_convert/app.py",
    (
        "docs/writing_an_environment.md",
        "unit_convert:",
    ): "resources_servers/unit_convert/configs/unit_convert.yaml",
    (
        "docs/writing_an_environment.md",
        '{"responses_create_params": {"input": [{"role": "user", "content": "How many miles is 42 km?"}]',
    ): "resources_servers/unit_convert/data/example.jsonl",
    (
        "docs/writing_an_environment.md",
        "from nemo_gym.tools.testing import example_rows, run_rollout, running_servers",
    ): "resources_servers/unit_convert/tests/test_app.py",
    ("resources_servers/example_multi_step/README.md", "policy_model:"): "my_script.yaml",
    ("resources_servers/example_session_state_mgmt/README.md", "policy_model:"): "my_script.yaml",
}

# Commands that serve in the foreground until stopped, and the output line that says they are ready.
BACKGROUND = {"ng_run": "servers ready!", "ng_viewer": "ng_viewer: open http"}
# Commands that start their own servers on the default head port: a background ng_run is stopped first.
OWN_SERVERS = ("ng_e2e_collect_rollouts", "ng_quickstart")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def block_id(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    def named_by(self, key: tuple[str, str]) -> bool:
        return self.doc == key[0] and self.block_id.startswith(key[1])

    @property
    def runnable(self) -> bool:
        return self.lang in RUN_LANGS

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line} [{self.lang or 'plain'}] {self.block_id[:80]!r}"


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")


def extract_blocks(markdown: str, doc: str) -> list[Block]:
    """Every fenced code block of ``markdown``, dedented by its fence's indentation. An unclosed fence
    is an error (the rest of the file would silently become one block)."""
    lines = markdown.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        lang = m.group("info").lower()
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            j += 1
        if j >= len(lines):
            raise ValueError(f"{doc}:{i + 1}: code fence {fence} is never closed")
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1 : j]]
        blocks.append(Block(doc=doc, line=i + 1, lang=lang, text="\n".join(body) + "\n"))
        i = j + 1
    return blocks


def documents(root: Path) -> list[str]:
    docs = ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]
    for kind in ("resources_servers", "responses_api_agents", "responses_api_models"):
        docs += sorted(str(p.relative_to(root)) for p in (root / kind).glob("*/README.md"))
    return docs


def all_blocks(root: Path) -> list[Block]:
    return [b for doc in documents(root) for b in extract_blocks((root / doc).read_text(), doc)]


def check_listing(
    blocks: list[Block], skip: dict[tuple[str, str], str], files: dict[tuple[str, str], str]
) -> list[str]:
    """Problems with the block listing: unknown languages, skip/file entries that match no block (or more
    than one), a file entry that names a block that is also skipped."""
    problems = [
        f"{b.where}: unknown fence language {b.lang!r}"
        for b in blocks
        if b.lang not in RUN_LANGS | DATA_LANGS
    ]
    for name, table in (("SKIP", skip), ("BLOCK_FILES", files)):
        for key in table:
            n = sum(b.named_by(key) for b in blocks)
            if n != 1:
                problems.append(f"{name} entry {key!r} matches {n} blocks (it must name exactly one)")
    problems += [
        f"{b.where} is both skip-listed and saved as a file"
        for b in blocks
        if _lookup(skip, b) is not None and _lookup(files, b) is not None
    ]
    for b in blocks:
        target = _lookup(files, b) or ""
        if b.lang == "jsonl" or target.endswith(".jsonl"):  # one JSON object per line (a `json` block
            for n, line in enumerate(b.text.splitlines()):  # may be an abbreviated illustration)
                problems += [f"{b.where}: line {n + 1} is not a JSON object: {e}" for e in _json_errors(line)]
    return problems


def _json_errors(text: str) -> list[str]:
    try:
        json.loads(text)
    except ValueError as e:
        return [str(e)]
    return []


def _lookup(table: dict[tuple[str, str], str], block: Block) -> str | None:
    return next((v for k, v in table.items() if block.named_by(k)), None)


def _logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined (kept verbatim, newlines included)."""
    out: list[str] = []
    cur = ""
    for line in text.splitlines():
        cur += line + "\n"
        if not line.rstrip().endswith("\\"):
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _first_word(command: str) -> str:
    stripped = command.strip()
    return stripped.split(None, 1)[0] if stripped else ""


def _console_commands(text: str) -> str:
    """A console block's commands: its ``$ `` lines (and their continuations); the rest is output."""
    out: list[str] = []
    cont = False
    for line in text.splitlines():
        if line.startswith("$ ") or cont:
            out.append(line[2:] if line.startswith("$ ") and not cont else line)
            cont = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


_PRELUDE = r"""
set -eo pipefail
__ng_bg_pids=()
__ng_bg_kinds=()
__ng_stop() {  # pid: SIGINT as Ctrl+C, then SIGTERM, then SIGKILL, each wait bounded
  local pid=$1 t
  kill -0 "$pid" 2>/dev/null || return 0
  for sig in INT TERM KILL; do
    kill -s "$sig" "$pid" 2>/dev/null || true
    for t in $(seq 1 150); do
      kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
      sleep 0.1
    done
  done
}
__ng_stop_kind() {  # stop the background servers of one kind (or all)
  local i
  for i in "${!__ng_bg_pids[@]}"; do
    if [ -z "$1" ] || [ "${__ng_bg_kinds[$i]}" = "$1" ]; then __ng_stop "${__ng_bg_pids[$i]}"; fi
  done
}
__ng_wait_ready() {  # pid log pattern
  local t
  for t in $(seq 1 $((__NG_READY_TIMEOUT_S * 10))); do
    if grep -qF "$3" "$2"; then return 0; fi
    if ! kill -0 "$1" 2>/dev/null; then
      echo "@@ background server exited before it was ready; its output:" >&2; cat "$2" >&2; return 1
    fi
    sleep 0.1
  done
  echo "@@ background server not ready within ${__NG_READY_TIMEOUT_S} s; its output:" >&2
  cat "$2" >&2; return 1
}
trap '__ng_stop_kind ""' EXIT
"""


def shell_script(blocks: list[Block], files: dict[tuple[str, str], str], scratch: Path) -> str:
    """One bash script that runs ``blocks`` in order, each announced by an ``@@block N@@`` line."""
    parts = [_PRELUDE, f"__NG_READY_TIMEOUT_S={READY_TIMEOUT_S}\n"]
    n_bg = 0
    for n, block in enumerate(blocks):
        parts.append(f"echo '@@block {n}@@'\n")
        target = _lookup(files, block)
        if target is not None:
            src = scratch / f"block_{n}.txt"
            src.write_text(block.text)
            parts.append(f"mkdir -p {shlex.quote(str(Path(target).parent))}\n")
            parts.append(f"cp {shlex.quote(str(src))} {shlex.quote(target)}\n")
            continue
        if block.lang in ("python", "py"):
            src = scratch / f"block_{n}.py"
            src.write_text(block.text)
            parts.append(f"timeout -k 10 {PYTHON_BLOCK_TIMEOUT_S} python {shlex.quote(str(src))}\n")
            continue
        text = _console_commands(block.text) if block.lang == "console" else block.text
        for command in _logical_lines(text):
            word = _first_word(command)
            if word in BACKGROUND:
                log = scratch / f"bg_{n_bg}.log"
                n_bg += 1
                parts.append(
                    f"__ng_stop_kind {word}\n"
                    f"(\nexec {command.rstrip()}\n) > {shlex.quote(str(log))} 2>&1 &\n"
                    f"__ng_bg_pids+=($!); __ng_bg_kinds+=({word})\n"
                    f"__ng_wait_ready $! {shlex.quote(str(log))} {shlex.quote(BACKGROUND[word])}\n"
                )
            else:
                if word in OWN_SERVERS:
                    parts.append("__ng_stop_kind ng_run\n")
                parts.append(command)
    parts.append("echo '@@done@@'\n")
    return "".join(parts)


# Brings the loopback interface of a fresh network namespace up (SIOCSIFFLAGS), then runs argv[1:].
_LO_UP = (
    "import fcntl, os, socket, struct, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', 0x1 | 0x8 | 0x40))\n"
    "s.close()\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def _netns_prefix() -> list[str]:
    """``unshare`` arguments for a private network namespace, or ``[]`` when none can be made here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    prefix = [unshare, "--net"] if os.geteuid() == 0 else [unshare, "--user", "--map-root-user", "--net"]
    probe = subprocess.run([*prefix, sys.executable, "-c", _LO_UP, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else []


# Each document runs on any pytest-xdist worker (docs/testing.md): in a network namespace of its own, or,
# where none can be made, on the host's port 11000 one at a time (_port_11000_alone).
SPLIT_ACROSS_WORKERS = True


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _copy_repo(dst: Path) -> None:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
        names = [n for n in listed.split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "venv", "results", "mlruns", "__pycache__", ".pytest_cache", ".ruff_cache"}
        names = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts)
        ]
    for name in names:
        src = REPO / name
        if not src.is_file():
            continue  # deleted in the work tree
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name)
    # `. .venv/bin/activate` in the docs: the venv running this test.
    (dst / ".venv").symlink_to(Path(sys.prefix))


def _processes_in(path: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == str(path) or cwd.startswith(str(path) + "/"):
            pids.append(int(proc.name))
    return pids


@dataclass
class DocRun:
    returncode: int
    output: str
    blocks: list[Block]
    workdir: Path
    leftover_pids: list[int]

    def failure(self) -> str | None:
        """None when every block ran; else which block failed and the output of the run from it on."""
        if self.returncode == 0 and "@@done@@" in self.output and not self.leftover_pids:
            return None
        started = re.findall(r"^@@block (\d+)@@$", self.output, flags=re.M)
        if self.leftover_pids:
            head = f"processes left running after the document's run: {self.leftover_pids}"
        elif started:
            head = f"exit status {self.returncode} in block {self.blocks[int(started[-1])].where}"
        else:
            head = f"exit status {self.returncode} before the first block"
        tail = self.output[self.output.rfind("@@block") :] if started else self.output
        return f"{head}\n{tail[-6000:]}"


def run_doc(
    blocks: list[Block], workdir: Path, files: dict[tuple[str, str], str], netns: list[str]
) -> DocRun:
    """Run ``blocks`` (of one document, skip-listed ones already left out) in ``workdir``."""
    scratch = workdir.parent / f"{workdir.name}_scratch"
    scratch.mkdir(exist_ok=True)
    script = scratch / "doc.sh"
    script.write_text(shell_script(blocks, files, scratch))
    home = workdir.parent / f"{workdir.name}_home"
    for sub in ("", "cache", "run"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    (home / "run").chmod(0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_GYM_", "PYTEST_", "XDG_"))}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_RUNTIME_DIR=str(home / "run"),
        PYTHONPATH=str(workdir),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONUNBUFFERED="1",
        MLFLOW_TRACKING_URI=str(workdir / "mlruns"),
        WANDB_MODE="offline",
    )
    env.pop("CI", None)  # a tool's own CI behaviour is not what a reader sees
    argv = [*netns, sys.executable, "-c", _LO_UP, "bash", str(script)] if netns else ["bash", str(script)]
    proc = subprocess.Popen(
        argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=DOC_TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        out += f"\n@@ timed out after {DOC_TIMEOUT_S} s\n".encode()
        code = -1
    deadline = time.monotonic() + 20
    left = _processes_in(workdir)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _processes_in(workdir)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return DocRun(code, out.decode(errors="replace"), blocks, workdir, left)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# What a document's run must have produced, beyond every block exiting 0.
def _check_readme(work: Path) -> None:
    rewards = [r["reward"] for r in _jsonl(work / "results/rollouts.jsonl")]
    assert rewards == [1.0] * 20, (
        f"the README walkthrough's scripted model should solve every rollout: {rewards}"
    )


def _check_writing_an_environment(work: Path) -> None:
    assert len(_jsonl(work / "results/unit_convert.jsonl")) == 1


def _check_trainers(work: Path) -> None:
    rewards = [r["reward"] for r in _jsonl(work / "results/mini_swe_agent.jsonl")]
    assert rewards == [1.0, 1.0], f"mini-swe-agent on the scripted model should fix both files: {rewards}"


CHECKS = {
    "README.md": _check_readme,
    "docs/writing_an_environment.md": _check_writing_an_environment,
    "docs/trainers.md": _check_trainers,
}


# ---------------------------------------------------------------------------------------------- tests


def test_every_block_is_run_or_listed() -> None:
    problems = check_listing(all_blocks(REPO), SKIP, BLOCK_FILES)
    assert not problems, "\n".join(problems)


def test_listing_check_catches_stale_and_unknown_entries() -> None:
    sample = (
        "# t\n\n```bash\necho hi\n```\n\n```rust\nfn main() {}\n```\n\n"
        '```json\n{"row": 1,\n "wrapped": true}\n```\n\n```jsonl\n{"a": 1}\n{"b": 2,}\n```\n'
    )
    blocks = extract_blocks(sample, "t.md")
    files = {("t.md", "echo hi"): "x.sh", ("t.md", '{"row"'): "data/example.jsonl"}
    problems = check_listing(blocks, {("t.md", "echo gone"): "moved"}, files)
    assert any("unknown fence language 'rust'" in p for p in problems)
    assert any("'echo gone'" in p and "matches 0 blocks" in p for p in problems)
    assert any("t.md:11 [json]" in p and "line 1 is not a JSON object" in p for p in problems)
    assert any("t.md:16 [jsonl]" in p and "line 2 is not a JSON object" in p for p in problems)
    assert len(problems) == 5, problems  # the wrapped row: both of its lines


def test_extractor_reads_indented_fences_and_refuses_unclosed_ones() -> None:
    sample = "- a step:\n\n  ```bash\n  echo one \\\n    two\n  ```\n\n````python\nprint('```')\n````\n"
    blocks = extract_blocks(sample, "t.md")
    assert [(b.lang, b.line, b.text) for b in blocks] == [
        ("bash", 3, "echo one \\\n  two\n"),
        ("python", 8, "print('```')\n"),
    ]
    assert _logical_lines(blocks[0].text) == ["echo one \\\n  two\n"]
    with pytest.raises(ValueError, match="t.md:1: code fence ``` is never closed"):
        extract_blocks("```bash\necho\n", "t.md")


def test_a_broken_doc_fails_at_its_block(tmp_path: Path) -> None:
    """The runner is not a rubber stamp: a failing command, a failing pipe stage, a Python snippet that
    cannot run (top-level await) and a foreground server that never gets ready each fail, naming the
    block; shell state carries over between the blocks of a document."""
    cases = {
        '```bash\nX=1\n```\n\n```bash\ntest "$X" = 1\nfalse\necho after\n```\n': "t.md:5 [bash]",
        "```sh\nfalse | cat\n```\n": "t.md:1 [sh]",
        "```python\nimport asyncio\nawait asyncio.sleep(0)\n```\n": "t.md:1 [python]",
        "```console\n$ true\nsome output\n$ exit 3\n```\n": "t.md:1 [console]",
        "```bash\nng_viewer +jsonl_fpath=does_not_exist.jsonl\n```\n": "t.md:1 [bash]",
    }
    for n, (markdown, where) in enumerate(cases.items()):
        work = tmp_path / f"w{n}"
        work.mkdir()
        run = run_doc(extract_blocks(markdown, "t.md"), work, {}, [])
        failure = run.failure()
        assert failure is not None and where in failure, (markdown, run.output)
        assert "after" not in run.output
    work = tmp_path / "ok"
    work.mkdir()
    ok = run_doc(
        extract_blocks('```bash\nX=1\n```\n\n```console\n$ test "$X" = 1\n```\n', "t.md"), work, {}, []
    )
    assert ok.failure() is None, ok.output


def _runnable_docs() -> list[str]:
    return [
        doc
        for doc in documents(REPO)
        if any(b.runnable and _lookup(SKIP, b) is None for b in extract_blocks((REPO / doc).read_text(), doc))
    ]


@pytest.fixture(scope="module")
def netns() -> list[str]:
    return _netns_prefix()


@contextlib.contextmanager
def _port_11000_alone(netns: list[str]) -> Iterator[None]:
    """Without a network namespace of its own, a document's servers use the host's port 11000: one
    document at a time on this machine (a lock file, held across pytest-xdist workers; the wait is
    bounded by every other document's timeout), and the port must be free."""
    if netns:
        yield
        return
    with (Path(tempfile.gettempdir()) / "nemo-gym-docs-port-11000.lock").open("a") as lock:
        deadline = time.monotonic() + DOC_TIMEOUT_S * len(_runnable_docs())
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail("another document held port 11000 past every document's timeout")
                time.sleep(0.2)
        try:
            if not _port_free(11000):
                pytest.fail(
                    "no private network namespace (unshare) here, and port 11000, the documents' head port, "
                    "is busy"
                )
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.mark.slow
@pytest.mark.parametrize("doc", _runnable_docs())
def test_doc_runs_as_pasted(doc: str, tmp_path: Path, netns: list[str]) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    _copy_repo(work)
    blocks = [
        b
        for b in extract_blocks((work / doc).read_text(), doc)
        if _lookup(SKIP, b) is None and (b.runnable or _lookup(BLOCK_FILES, b) is not None)
    ]
    with _port_11000_alone(netns):
        run = run_doc(blocks, work, BLOCK_FILES, netns)
    failure = run.failure()
    assert failure is None, textwrap.indent(failure, "  ")
    if doc in CHECKS:
        CHECKS[doc](work)
