"""Fixtures for tests that run the ``ng_*`` commands as real subprocesses.

Every process a test starts carries a unique marker in its environment (children inherit it), so
the test can find *all* of its processes, however they were spawned, and kill them by pid in a
``finally`` block: a failing test leaves nothing behind. Output is drained on threads so a chatty
child can never block on a full pipe.

Test modules import the helpers with ``from tests.conftest import ...`` (pytest registers this
module under that name before it imports the tests next to it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
import pytest
import uvicorn

from nemo_gym.auth import auth_headers, read_token_file, token_file_for
from tests.ray_cluster import driver_of, ray_environment, two_node_cluster

REPO = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
MARKER_ENV = "NEMO_GYM_TEST_PROCESS_MARKER"
EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
SCRIPTED_MODEL_CONFIG = "responses_api_models/scripted_model/configs/scripted_model.yaml"
EXAMPLE_CONFIG_PATHS = f"+config_paths=[{EXAMPLE_CONFIG},{SCRIPTED_MODEL_CONFIG}]"
EXAMPLE_INSTANCES = ("example_single_tool_call", "example_single_tool_call_simple_agent", "policy_model")
READY_WAIT_S = 120.0  # bound on start-up on a busy 2-core machine (a wait bound, not a speed check)
HANG_BOUND_S = 5.0  # the required "stops within 5 s" bound
READY_RE = re.compile(r"All (\d+) / (\d+) servers ready!")
HEAD_RE = re.compile(r"^Head server: (http://\S+)$")


class LaunchedProcess:
    """One ``ng_*`` command started in its own session, with its output captured line by line."""

    def __init__(
        self,
        cmd: list[str],
        cwd: Path,
        env_extra: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.cmd = cmd
        self.marker = uuid.uuid4().hex
        env = dict(os.environ)
        env.update(env_extra or {})
        env[MARKER_ENV] = self.marker
        self._lines: list[tuple[str, str]] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True),
        ]
        for t in self._readers:
            t.start()

    # -- output -------------------------------------------------------------------------------------
    def _read(self, stream: IO[bytes], label: str) -> None:
        for raw in iter(stream.readline, b""):
            with self._cond:
                self._lines.append((label, raw.decode(errors="replace").rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _text(self, label: str | None) -> str:
        with self._cond:
            return "\n".join(line for lab, line in self._lines if label is None or lab == label)

    @property
    def stdout(self) -> str:
        """Everything printed on stdout so far."""
        return self._text("out")

    @property
    def stderr(self) -> str:
        """Everything printed on stderr so far."""
        return self._text("err")

    @property
    def output(self) -> str:
        """Both streams, interleaved in arrival order."""
        return self._text(None)

    def _outputs_done(self) -> bool:
        return not any(t.is_alive() for t in self._readers)

    def wait_for_line(self, pattern: str | re.Pattern[str], timeout: float) -> str | None:
        """The first line matching ``pattern``; None if the command's output ended or ``timeout`` passed."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _lab, line in self._lines:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self._outputs_done():
                    return None
                self._cond.wait(timeout=min(left, 0.2))

    def wait_ready(self, timeout: float = READY_WAIT_S) -> int:
        """Wait for the ready line; fail the test with the output if it does not come. Returns the server count."""
        line = self.wait_for_line(READY_RE, timeout)
        if line is None:
            pytest.fail(
                f"ng_run did not become ready within {timeout:.0f} s (exit code {self.proc.poll()}).\n"
                f"--- output ---\n{self.output[-6000:]}"
            )
        m = READY_RE.search(line)
        assert m is not None and m.group(1) == m.group(2)
        return int(m.group(1))

    @property
    def head_url(self) -> str:
        """The head server URL printed after the ready line."""
        line = self.wait_for_line(HEAD_RE, 10)
        assert line is not None, f"no 'Head server:' line in:\n{self.output}"
        m = HEAD_RE.search(line)
        assert m is not None
        return m.group(1)

    @property
    def token(self) -> str:
        """The run token, from the file ng_run writes for its head server's port."""
        port = int(self.head_url.rsplit(":", 1)[1].split("/")[0])
        token = read_token_file(token_file_for(port))
        assert token, f"no token file for head port {port}"
        return token

    # -- processes ----------------------------------------------------------------------------------
    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the command is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self._readers:
            t.join(timeout=5)
        return code

    def our_processes(self) -> list[psutil.Process]:
        """Every live (non-zombie) process carrying this launch's marker: the command and all it started."""
        found = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(MARKER_ENV) == self.marker and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
                continue
        return found

    def wait_no_processes(self, timeout: float = HANG_BOUND_S) -> list[psutil.Process]:
        """Poll until none of our processes is left; returns those still alive at the bound."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.our_processes()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def send_signal(self, sig: int) -> None:
        """Signal the command itself (not its children)."""
        self.proc.send_signal(sig)

    def cleanup(self) -> None:
        """SIGKILL everything this launch started (by pid), then reap the command."""
        for p in self.our_processes():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for t in self._readers:
            t.join(timeout=2)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class Launcher:
    """Starts ``ng_*`` commands and remembers them so they can all be cleaned up."""

    def __init__(self) -> None:
        self.started: list[LaunchedProcess] = []

    def __call__(
        self,
        *args: str,
        cmd: str = "ng_run",
        cwd: Path = REPO,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> LaunchedProcess:
        """Start ``cmd``; ``preexec_fn`` runs in the child before exec (e.g. to set resource limits)."""
        launched = LaunchedProcess([str(BIN_DIR / cmd), *args], cwd, env, preexec_fn)
        self.started.append(launched)
        return launched

    def cleanup(self) -> None:
        """Clean up every command started through this launcher."""
        for launched in self.started:
            launched.cleanup()


@pytest.fixture
def launch() -> Iterator[Launcher]:
    """Start ``ng_*`` commands for one test; everything they started is killed afterwards."""
    launcher = Launcher()
    try:
        yield launcher
    finally:
        launcher.cleanup()


@pytest.fixture(scope="module")
def launch_module() -> Iterator[Launcher]:
    """Like ``launch``, for a run shared by the tests of one module."""
    launcher = Launcher()
    try:
        yield launcher
    finally:
        launcher.cleanup()


@pytest.fixture(scope="module")
def ray_env() -> Iterator[None]:
    """The environment every Ray process of a test module runs with (tests/ray_cluster.py)."""
    yield from ray_environment()


@pytest.fixture(scope="module")
def ray_cluster(ray_env: None) -> Iterator[Any]:
    """A real 2-node Ray cluster for one test module (tests/ray_cluster.py), gone afterwards."""
    yield from two_node_cluster()


@pytest.fixture
def ray_driver(ray_cluster: Any) -> Iterator[Any]:
    """This test process connected to the module's cluster as a driver (disconnected afterwards)."""
    yield from driver_of(ray_cluster)


@contextlib.contextmanager
def serve_app(app: Any, *, lifespan: str = "off", bound_s: float = 15.0) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a thread on a free port of 127.0.0.1; yields its base URL.

    ``lifespan="on"`` runs the app's start-up and shut-down hooks (what an MCP session manager or the
    metrics' loop-lag tick needs). Starting and stopping are each bounded by ``bound_s``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + bound_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert server.started, "test server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(bound_s)
        sock.close()


def get_json(url: str, timeout: float = 10, token: str | None = None) -> Any:
    """GET ``url`` (with the run ``token`` when given) and return its JSON body, asserting a 200."""
    resp = httpx.get(url, timeout=timeout, trust_env=False, headers=auth_headers(token))
    assert resp.status_code == 200, f"GET {url} answered {resp.status_code}: {resp.text[:1000]}"
    return resp.json()


def write_server_folder(
    root: Path, server_type: str, impl: str, app_source: str, requirements: str | None = None
) -> Path:
    """Create ``root/<server_type>/<impl>/app.py`` (and ``requirements.txt``); returns the folder."""
    folder = root / server_type / impl
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(textwrap.dedent(app_source).lstrip())
    if requirements is not None:
        (folder / "requirements.txt").write_text(requirements)
    return folder


def write_instance_config(root: Path, instance: str, server_type: str, impl: str, **fields: Any) -> Path:
    """Write ``root/configs/<instance>.yaml`` with one server instance; returns its path."""
    lines = [f"{instance}:", f"  {server_type}:", f"    {impl}:", "      entrypoint: app.py"]
    lines += [f"      {k}: {v}" for k, v in fields.items()]
    path = root / "configs" / f"{instance}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


SIMPLE_RESOURCES_APP = """
    import sys

    from nemo_gym.base_resources_server import (
        BaseResourcesServerConfig,
        BaseVerifyRequest,
        BaseVerifyResponse,
        SimpleResourcesServer,
    )

    {prelude}


    class ProbeConfig(BaseResourcesServerConfig):
        pass


    class ProbeServer(SimpleResourcesServer):
        config: ProbeConfig

        def setup_webserver(self):
            app = super().setup_webserver()
            app.get("/env_info")(self.env_info)
            return app

        async def env_info(self) -> dict:
            return {{"prefix": sys.prefix, "executable": sys.executable, {env_info_extra}}}

        async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
            return BaseVerifyResponse(**body.model_dump(), reward=1.0)


    if __name__ == "__main__":
        ProbeServer.run_webserver()
"""


def simple_resources_app(prelude: str = "", env_info_extra: str = "") -> str:
    """Source of a minimal real resources server with ``GET /env_info`` (``prelude`` runs at import)."""
    return SIMPLE_RESOURCES_APP.format(
        prelude=textwrap.indent(textwrap.dedent(prelude), "    ").strip(), env_info_extra=env_info_extra
    )
