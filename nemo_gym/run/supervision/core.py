""":class:`ServerSupervisor`: start, watch and stop the server processes of one run.

Contract
--------
* ``start()`` reserves every port first (see :mod:`nemo_gym.config.ports`), spawns one child per server
  instance (each in its own process group, its output prefixed with the instance name), starts the
  head server in this process while they load, and health-polls them all within ``startup_timeout_s``.
  If a child exits or the bound passes, it stops everything and raises :class:`StartupError`
  naming the server with its last log lines.
* Every child loads its code and checks its config block against its config class, reports the
  verdict over a pipe, and waits. Only when every child's config is valid are they all told to go
  on (build the server, run start-up hooks, serve); otherwise everything stops and one
  :class:`ConfigError` lists every server's problems with file:line and "did you mean"
  (:mod:`nemo_gym.run.supervision.verdicts`).
* Secrets never leave through the logs: every line relayed from a child (to the terminal, the
  ``log_dir`` files and error messages) is scrubbed (:mod:`nemo_gym.redaction`) of the secret values
  of the config and of ``env.yaml``. Each child is told only its own secret values and the run token
  (``NEMO_GYM_SECRET_VALUES``) so it can scrub its own error bodies, and inherits the launcher's
  environment without secret-looking variables (except its block's ``pass_env``):
  :mod:`nemo_gym.run.supervision.spawning`.
* ``dead_server()`` reports a child that has exited since start, or an instance placed on Ray whose
  every replica is dead. Ray-placed replicas check their config blocks on their nodes and report
  their verdicts with the local ones: nothing serves until every config is valid.
* Servers that run on this interpreter with the run's import path are forked from the fork server
  (:mod:`nemo_gym.run.zygote`, on unless ``+fork_server=false``): one process that imported the web
  stack once, stopped once every server is started (they are this process's children). Any other
  server, or any the fork server cannot start, is spawned as its own process. Both kinds are
  watched, relayed and stopped alike.
* ``shutdown()`` sends SIGTERM to every child's process group, then SIGKILL after
  ``shutdown_timeout_s``; it is idempotent and also runs at interpreter exit.
* Children also die on their own when this process dies, even by SIGKILL (parent-death signal
  plus a parent watch in :func:`nemo_gym.server.startup.die_with_parent`). Linux delivers the
  parent-death signal when the *thread* that forked the child exits, so every child is spawned
  from one long-lived thread owned by the supervisor: ``RunHelper().start()`` may be called from
  a short-lived thread (a trainer's worker, ``asyncio.to_thread``) without its servers dying.

The class is assembled from one mixin per concept (the sibling modules); this module holds its state
(``__init__``), its output and the order of start-up.
"""

from __future__ import annotations

import atexit
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from nemo_gym.auth import SERVER_AUTH_KEY_NAME, new_run_token
from nemo_gym.client.replicas import REPLICAS_KEY_NAME, new_replica_identity
from nemo_gym.config.instances import ServerInstance, find_server_dir
from nemo_gym.config.keys import (
    DEFAULT_HEAD_SERVER_HOST,
    DEFAULT_HEAD_SERVER_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    HEAD_SERVER_KEY_NAME,
)
from nemo_gym.config.loading import LoadedConfig
from nemo_gym.config.network import configured_port_range
from nemo_gym.config.ports import reserve_listening_socket, reserve_listening_socket_in_range
from nemo_gym.redaction import (
    Scrubber,
    add_secret_values,
    config_secret_values,
    env_yaml_secret_values,
    process_scrubber,
)
from nemo_gym.run.server_venvs import check_shared_requirements, ensure_server_venv
from nemo_gym.run.supervision.children import ChildServer, DeadRayInstance, SpawnerThread, StartupError
from nemo_gym.run.supervision.head import HeadMixin
from nemo_gym.run.supervision.instances import InstancesMixin
from nemo_gym.run.supervision.placement import PlacementMixin
from nemo_gym.run.supervision.ray_groups import RayGroupsMixin
from nemo_gym.run.supervision.readiness import ReadinessMixin
from nemo_gym.run.supervision.shutdown import ShutdownMixin
from nemo_gym.run.supervision.spawning import SpawningMixin
from nemo_gym.run.supervision.stop import StopFlag
from nemo_gym.run.supervision.verdicts import VerdictsMixin
from nemo_gym.run.zygote import Zygote
from nemo_gym.server.startup import startup_mark


class ServerSupervisor(
    PlacementMixin,
    RayGroupsMixin,
    HeadMixin,
    SpawningMixin,
    VerdictsMixin,
    ReadinessMixin,
    InstancesMixin,
    ShutdownMixin,
):
    """Starts the head server and one child process per server instance; see the module docstring."""

    def __init__(
        self,
        loaded: LoadedConfig,
        instances: list[ServerInstance],
        echo: Callable[[str], None] | None = None,
        stop_event: threading.Event | StopFlag | None = None,
        zygote: Zygote | None = None,
    ):
        self.loaded = loaded
        self.cfg = loaded.config
        self.instances = instances
        self.children: list[ChildServer] = []
        self.stop_event = stop_event or threading.Event()
        self._print_lock = threading.Lock()
        self._echo = echo
        self._head_server: Any = None
        self._head_sock: socket.socket | None = None
        self._head_thread: threading.Thread | None = None
        self.ray_connection: Any = None  # nemo_gym.run.ray.cluster.RayConnection when the config uses Ray
        # Instances placed on the Ray cluster: name -> nemo_gym.run.ray.replicas.RayReplicaGroup.
        self.ray_groups: dict[str, Any] = {}
        self.head_host = str(
            OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.host", default=None)
            or self.cfg.get("default_host")
            or DEFAULT_HEAD_SERVER_HOST
        )
        port = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None)
        self.head_port: int = DEFAULT_HEAD_SERVER_PORT if port is None else int(port)
        self.startup_timeout_s = float(
            OmegaConf.select(self.cfg, "startup_timeout_s", default=None) or DEFAULT_STARTUP_TIMEOUT_S
        )
        self.shutdown_timeout_s = float(
            OmegaConf.select(self.cfg, "shutdown_timeout_s", default=None) or DEFAULT_SHUTDOWN_TIMEOUT_S
        )
        log_dir = OmegaConf.select(self.cfg, "log_dir", default=None)
        self.log_dir = Path(log_dir) if log_dir else None
        self.isolate = bool(OmegaConf.select(self.cfg, "isolate_server_venvs", default=False))
        self.venv_cache_dir = OmegaConf.select(self.cfg, "venv_cache_dir", default=None)
        # The run token every request to every server of this run must carry (see nemo_gym.auth).
        self._shut_down = False
        self._ray_dead: DeadRayInstance | None = None
        self._ray_checked_at = 0.0
        self._spawner = SpawnerThread()
        self._launch_files: Path | None = None  # the children's private launch files (nemo_gym.launch)
        self._launch_lock = threading.Lock()
        self.launch_values: dict[str, dict[str, str]] = {}  # child label -> what its launch file held
        # The fork server the servers are forked from (ng_run starts it before it reads the config;
        # otherwise start() does, when some server can use it): nemo_gym.run.zygote.
        self._zygote = zygote
        # Every secret value this run knows: scrubbed from relayed log lines and error messages.
        self.auth_enabled = OmegaConf.select(self.cfg, SERVER_AUTH_KEY_NAME, default=True) not in (
            False,
            "false",
            0,
        )
        self.auth_token: str | None = new_run_token() if self.auth_enabled else None
        # The trainer credential (POST /policy_version): this process's and the token file's, no server's.
        self.trainer_token: str | None = new_run_token() if self.auth_enabled else None
        self.token_file: Path | None = None
        # The run token is a secret too: scrubbed from every log line and error body, in every process.
        self.env_secret_values = sorted(
            env_yaml_secret_values(loaded.env_yaml_data)
            | {self.auth_token or "", self.trainer_token or ""} - {""}
        )
        add_secret_values(config_secret_values(self.cfg, loaded.env_yaml_data) | set(self.env_secret_values))
        atexit.register(self.shutdown)

    # -- output --------------------------------------------------------------------------------------
    def echo(self, line: str) -> None:
        """Print one line, secrets scrubbed (thread-safe; through ``echo`` when one was given)."""
        self._emit(process_scrubber().scrub(line))

    def _emit(self, line: str) -> None:
        with self._print_lock:
            if self._echo is not None:
                self._echo(line)
            else:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything and return once every server answers; stop everything and raise otherwise."""
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        server_dirs: dict[str, Path] = {}
        for inst in self.instances:
            folder = find_server_dir(inst, self.loaded.root_dir)
            assert folder is not None  # validated before
            server_dirs[inst.name] = folder
        if not self.isolate:
            check_shared_requirements(server_dirs)

        # 1. Every port, before anything starts (replicas placed on Ray open theirs on their nodes).
        self._check_explicit_ports_distinct()
        self._connect_ray()
        head_sock = reserve_listening_socket(
            self.head_host,
            self.head_port,
            f"the head server ({HEAD_SERVER_KEY_NAME}.port)",
            busy_hint=self._head_port_busy_hint,
        )
        self._head_sock = head_sock  # closed by shutdown() whatever happens next
        self.head_port = head_sock.getsockname()[1]
        OmegaConf.update(
            self.cfg, HEAD_SERVER_KEY_NAME, {"host": self.head_host, "port": self.head_port}, force_add=True
        )
        try:
            for inst in self.instances:
                block = OmegaConf.select(self.cfg, inst.config_key)
                num_replicas = self._num_replicas(inst, block)
                if self._placed_on_ray(inst, block):
                    self._reserve_ray_replicas(inst, block, num_replicas)
                    continue
                host = str(block.get("host") or self.cfg.get("default_host") or "127.0.0.1")
                explicit = block.get("port")
                where = self.loaded.provenance.where(f"{inst.config_key}.port")
                what = f"server '{inst.name}'" + (f" (port set at {where})" if explicit and where else "")
                port_range = configured_port_range(self.cfg)
                replicas = []
                for index in range(num_replicas):
                    asked = int(explicit) if explicit and index == 0 else None
                    if asked or port_range is None:
                        sock = reserve_listening_socket(host, asked, what)
                    else:  # upstream's port_range_low/high: automatically chosen ports come from the range
                        sock = reserve_listening_socket_in_range(
                            host, *port_range, what, avoid={self.head_port}
                        )
                    port = sock.getsockname()[1]
                    entry = str(block.get("entrypoint") or "app.py")
                    replicated = num_replicas > 1
                    self.children.append(
                        ChildServer(
                            instance=inst,
                            host=host,
                            port=port,
                            python=sys.executable,
                            script=server_dirs[inst.name] / entry,
                            sock=sock,
                            replica=index if replicated else None,
                            identity=new_replica_identity(index) if replicated else None,
                        )
                    )
                    replicas.append(
                        {"host": host, "port": port, "url": f"http://{host}:{port}", "node": None}
                    )
                # The first replica's address is the instance's (what clients without routing use).
                block["host"], block["port"] = host, replicas[0]["port"]
                if num_replicas > 1:
                    block[REPLICAS_KEY_NAME] = replicas
        except BaseException:
            head_sock.close()
            raise

        startup_mark("ports")
        # 2. Per-server environments (only in isolated mode; a no-op when nothing changed).
        if self.isolate:
            for child in self.children:
                child.python = str(
                    ensure_server_venv(
                        child.script.parent,
                        child.name,
                        self.venv_cache_dir,
                        echo=self.echo,
                        should_stop=self.stop_event.is_set,
                    )
                )

        # 3. The children, and the head server (in this process).
        if self.stop_event.is_set():
            raise StartupError("Start-up interrupted.")
        self._prepare_zygote()
        self._publish_token()
        secret = secrets.token_hex(32)
        # Every secret value of the run: what other servers' blocks must not show to a child.
        run_scrubber = Scrubber(config_secret_values(self.cfg, self.loaded.env_yaml_data))
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        # The head server starts while the children load their code (its socket listens already, so a
        # child that asks it something early waits in its backlog), not before they are spawned; with
        # a fork server, while it imports the shared modules (the children are forked once it has).
        if self._zygote is not None:
            self._start_head_server(head_sock)
            startup_mark("head")
        for child in self.children:
            self._spawn(child, self._child_config_yaml(child, run_scrubber), secret, run_scrubber)
        if self._zygote is not None:  # its servers are this process's children now: it has done its work
            self._stop_zygote()
        else:
            self._start_head_server(head_sock)
            startup_mark("head")

        # 4. Every child checks its config, then all go on together; health-poll with a bound.
        deadline = time.monotonic() + self.startup_timeout_s
        self._start_ray_replicas(run_scrubber, secret)  # they check their configs too, then wait for go
        self._wait_config_verdicts(deadline)
        startup_mark("verdicts")
        self._wait_ready(deadline)
        self._wait_ray_replicas(deadline)
        startup_mark("ready_all")
