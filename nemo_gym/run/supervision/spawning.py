"""Spawning a run's children: the config each receives, its environment, and its log relay.

Contract
--------
* A child's config (:meth:`SpawningMixin._child_config_yaml`) holds its own block whole
  (interpolations resolved, its own secrets included), every other server's block with secrets
  redacted, and the top-level values that are neither secret-looking nor from env.yaml.
* A child's environment (:meth:`SpawningMixin._child_env`) is the launcher's without its secret-looking
  variables (except those its block names in ``pass_env``), plus the path of its private launch file
  (:mod:`nemo_gym.launch`), which holds its config, the cookie-signing secret, the run token and its own
  secret values (what its block holds; never another server's secret). None of these is in its
  environment, so nothing it starts inherits them; the file is removed by the child once read, and the
  run's launch directory at stop. ``launch_values[<label>]`` keeps what each child was handed (the
  launcher holds every one of these values anyway), for the launcher's own checks and tests.
* :meth:`SpawningMixin._spawn` forks the child from the fork server (:mod:`nemo_gym.run.zygote`) when
  it runs on this interpreter with the run's import path, else starts it on the supervisor's spawner
  thread; either way as this process's child, in its own process group. It hands the child its
  listening socket and its config-verdict pipes, then closes this process's copies. Its output is
  relayed line by line, scrubbed of secrets, prefixed with its label, to the terminal, its last lines
  and its ``log_dir`` file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import yaml
from omegaconf import OmegaConf

from nemo_gym.auth import (
    AUTH_DISABLED_ENV_VAR_NAME,
    AUTH_TOKEN_ENV_VAR_NAME,
    TRAINER_TOKEN_SHA256_ENV_VAR_NAME,
    token_sha256,
)
from nemo_gym.client.replicas import REPLICA_ENV_VAR_NAME, REPLICAS_KEY_NAME
from nemo_gym.config.flags import config_flag
from nemo_gym.config.keys import (
    ENV_YAML_FNAME,
    FORK_SERVER_KEY_NAME,
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME,
    NEMO_GYM_PARENT_PID_ENV_VAR_NAME,
    NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME,
    NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME,
)
from nemo_gym.launch import LAUNCH_FILE_ENV_VAR_NAME, write_launch_file
from nemo_gym.redaction import (
    NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME,
    PASS_ENV_KEY_NAME,
    Scrubber,
    child_environ,
    is_secret_key,
    own_secret_values,
    process_scrubber,
    redact_config,
)
from nemo_gym.run.supervision.children import ChildServer, SpawnerThread, StartupError
from nemo_gym.run.zygote import HELLO_TIMEOUT_S, ForkedChild, Zygote, ZygoteUnavailable, zygote_environ
from nemo_gym.server.startup import startup_mark

_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's, when PyYAML has it


# -- fork servers kept between runs ------------------------------------------------------------------
# A process that starts one run after another (a test suite, a trainer that starts servers for each
# evaluation) can keep one fork server per root for all of them: keep_fork_servers(True). Each run then
# forks its servers at once instead of waiting for a new fork server to import FastAPI and the server
# bases again (~1 CPU-second a run). A kept one is started on a thread of its own that lives as long as
# the process (the parent-death signal follows the thread that forked it) and stops at the process's
# exit; one that fails is replaced at the next run. Off by default: ng_run starts one run.

_KEEP = {"on": False}
_KEPT: dict[str, Zygote] = {}
_KEPT_LOCK = threading.Lock()
_KEPT_SPAWNER = SpawnerThread()


def keep_fork_servers(on: bool = True) -> None:
    """Keep (True) or stop keeping (False) one fork server per root for every later run of this process."""
    with _KEPT_LOCK:
        _KEEP["on"] = on
        if not on:
            for zygote in _KEPT.values():
                zygote.stop()
            _KEPT.clear()


def kept_fork_server(root: str) -> Zygote | None:
    """This process's kept fork server for ``root``, or None when fork servers are not kept. It is started
    now if there is none, or replaced when it has exited or failed, or when it no longer starts servers
    as this process would now (its interpreter-start variables, ``PYTHONPATH`` among them, were read from
    this process's environment when it started, and the environment has changed since)."""
    with _KEPT_LOCK:
        if not _KEEP["on"]:
            return None
        zygote = _KEPT.get(root)
        exited = zygote is not None and zygote.process is not None and zygote.process.poll() is not None
        if zygote is None or exited or not zygote.compatible(sys.executable, zygote_environ(root), root):
            if zygote is not None:
                zygote.stop()
            zygote = _KEPT[root] = Zygote.start(root, spawn=_KEPT_SPAWNER.call)
        return zygote


def kept_fork_server_pids() -> set[int]:
    """The process ids of this process's kept fork servers (children of this process that outlive its
    runs on purpose: what a check for processes left behind by a run leaves out)."""
    with _KEPT_LOCK:
        return {z.pid for z in _KEPT.values() if z.pid is not None}


def is_kept(zygote: Zygote) -> bool:
    """Whether ``zygote`` is kept between runs (then no run stops it)."""
    return any(kept is zygote for kept in _KEPT.values())


class SpawningMixin:
    """Spawning children and the config each receives (mixed into :class:`ServerSupervisor`)."""

    def _child_config_yaml(self, child: ChildServer, run_scrubber: Scrubber) -> str:
        """The config ``child`` receives: its own block whole (interpolations resolved, its own secrets
        included), every other server's block with secrets redacted (a judge's model name is readable,
        its API key is not), and the top-level values that are neither secret-looking nor from env.yaml.
        A replica's own block names its own address; every block lists the instance's ``replicas``."""
        return self._config_yaml_for(child.name, child.host, child.port, run_scrubber)

    def _config_yaml_for(self, name: str, host: str, port: int, run_scrubber: Scrubber) -> str:
        cfg = self.cfg
        out: dict[str, Any] = {}
        instance_keys = {inst.name for inst in self.instances}
        for key in cfg.keys():
            key = str(key)
            if key in instance_keys:
                continue
            where = self.loaded.provenance.where(key) or ""
            if is_secret_key(key) or where.startswith(ENV_YAML_FNAME + ":"):
                continue
            try:
                out[key] = run_scrubber.scrub_obj(_resolved(cfg, key))
            except Exception:  # a value only other servers interpolate may be unresolvable here: leave it out
                continue
        for other in self.instances:
            if other.name == name:
                continue
            impl = OmegaConf.select(cfg, other.config_key)
            address: dict[str, Any] = {"host": impl.get("host"), "port": impl.get("port")}
            if impl.get(REPLICAS_KEY_NAME) is not None:
                address[REPLICAS_KEY_NAME] = OmegaConf.to_container(impl[REPLICAS_KEY_NAME])
            try:
                block = redact_config(_resolved(cfg, other.name), run_scrubber)
                impl_block = block[other.server_type][other.impl]
                impl_block.update(address)
            except Exception:  # unresolvable: the address is all another server needs
                block = {other.server_type: {other.impl: address}}
            out[other.name] = block
        try:
            own = _resolved(cfg, name)
        except Exception as e:
            raise StartupError(f"Cannot resolve the config of server '{name}': {e}") from None
        inst = next(i for i in self.instances if i.name == name)
        own[inst.server_type][inst.impl].update({"host": host, "port": port})
        out[name] = own
        return yaml.dump(out, Dumper=_YAML_DUMPER, sort_keys=False)

    def _own_secrets_json(self, name: str, run_scrubber: Scrubber) -> str:
        """``NEMO_GYM_SECRET_VALUES`` of server ``name``: the secret values its own block holds (found
        by the redaction rules, or one of the run's secrets inside one of its strings) and the run
        token, so it can scrub them from its error bodies and logs. Another server's secrets are not
        among them."""
        try:
            own = _resolved(self.cfg, name)
        except Exception:  # reported by _config_yaml_for, which runs first
            own = {}
        values = own_secret_values(own, run_scrubber.values)
        if self.auth_token:
            values.add(self.auth_token)
        return json.dumps(sorted(values))

    def _pass_env(self, name: str) -> list[str]:
        """The launcher variables server ``name`` asks for by name (its block's ``pass_env``)."""
        inst = next(i for i in self.instances if i.name == name)
        names = OmegaConf.select(self.cfg, f"{inst.config_key}.{PASS_ENV_KEY_NAME}", default=None)
        if names is None:
            return []
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise StartupError(
                f"'{inst.config_key}.{PASS_ENV_KEY_NAME}' must be a list of environment variable names, "
                f"e.g. [OPENAI_API_KEY]; got {OmegaConf.to_container(names) if OmegaConf.is_config(names) else names!r}"
            )
        return [str(n) for n in names]

    def _child_env(
        self, child: ChildServer, config_yaml: str, secret: str, run_scrubber: Scrubber
    ) -> dict[str, str]:
        """The environment ``child`` starts with (see the module docstring)."""
        env = child_environ(os.environ, self._pass_env(child.name))
        root = str(self.loaded.root_dir)
        private = {
            NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: config_yaml,
            NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME: secret,
            AUTH_TOKEN_ENV_VAR_NAME: self.auth_token or "",
            TRAINER_TOKEN_SHA256_ENV_VAR_NAME: token_sha256(self.trainer_token) if self.trainer_token else "",
            NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME: self._own_secrets_json(child.name, run_scrubber),
        }
        for name in private:
            env.pop(name, None)  # the launcher's own (a run started from a server): never passed on
        self.launch_values[child.label] = private
        env.update(
            {
                LAUNCH_FILE_ENV_VAR_NAME: str(write_launch_file(self._launch_dir(), child.label, private)),
                NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: child.name,
                NEMO_GYM_PARENT_PID_ENV_VAR_NAME: str(os.getpid()),
                AUTH_DISABLED_ENV_VAR_NAME: "" if self.auth_enabled else "1",
                REPLICA_ENV_VAR_NAME: child.identity or "",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
            }
        )
        return env

    def _launch_dir(self) -> Path:
        """The run's private directory of launch files (0700; removed at stop)."""
        with self._launch_lock:  # children are spawned from several threads
            if self._launch_files is None:
                self._launch_files = Path(tempfile.mkdtemp(prefix="nemo-gym-launch-"))
            return self._launch_files

    def _spawn(self, child: ChildServer, config_yaml: str, secret: str, run_scrubber: Scrubber) -> None:
        assert child.sock is not None
        env = self._child_env(child, config_yaml, secret, run_scrubber)
        root = str(self.loaded.root_dir)
        fd = child.sock.fileno()
        verdict_r, verdict_w = os.pipe()
        go_r, go_w = os.pipe()
        child.verdict_fd, child.go_fd = verdict_r, go_w
        forking = self._can_fork(child, env, root)  # waits for the fork server's imports
        startup_mark("spawn", child.label)
        try:
            child.process = self._fork(child, env, root, (fd, verdict_w, go_r)) if forking else None
            if child.process is None:
                env[NEMO_GYM_LISTEN_FD_ENV_VAR_NAME] = str(fd)
                env[NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME] = f"{verdict_w},{go_r}"
                child.process = self._spawner.call(
                    lambda: subprocess.Popen(
                        [child.python, str(child.script)],
                        cwd=root,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        pass_fds=(fd, verdict_w, go_r),
                        start_new_session=True,
                    )
                )
        finally:
            # The child holds the socket and its pipe ends now; ours must go (the port dies with the
            # child, and its exit is seen as the end of its verdict pipe).
            os.close(verdict_w)
            os.close(go_r)
        child.sock.close()
        child.sock = None
        log_file: IO[str] | None = None
        if self.log_dir:
            suffix = "" if child.replica is None else f".{child.replica}"
            log_file = open(self.log_dir / f"{child.name}{suffix}.log", "a", buffering=1)
        child.reader = threading.Thread(
            target=self._pump, args=(child, log_file), name=f"log-{child.label}", daemon=True
        )
        child.reader.start()

    def _prepare_zygote(self) -> None:
        """Have a fork server when ``fork_server`` is on (the default) and some server runs on this
        interpreter; stop one that is not wanted (ng_run starts it before it knows the config)."""
        wanted = config_flag(self.cfg, FORK_SERVER_KEY_NAME, True) and any(
            c.python == sys.executable for c in self.children
        )
        root = os.path.realpath(self.loaded.root_dir)
        if self._zygote is not None and (not wanted or os.path.realpath(self._zygote.root) != root):
            self._stop_zygote()
            self._zygote = None
        if wanted and self._zygote is None:
            self._zygote = kept_fork_server(root) or Zygote.start(root, spawn=self._spawner.call)

    def _stop_zygote(self) -> None:
        """Stop this run's fork server once it has done its work, unless it is kept between runs."""
        if self._zygote is not None and not is_kept(self._zygote):
            self._zygote.stop()

    def _can_fork(self, child: ChildServer, env: dict[str, str], root: str) -> bool:
        """Whether ``child`` is to be forked from the fork server: it runs on this interpreter with the
        run's import path, and the fork server is ready (waited for: it imports while the launcher
        reads the config and starts the head server)."""
        zygote = self._zygote
        if zygote is None or not zygote.compatible(child.python, env, root):
            return False
        try:
            zygote.wait_ready(min(self.startup_timeout_s, HELLO_TIMEOUT_S))
        except ZygoteUnavailable as e:
            self.echo(
                f"nemo_gym: the fork server cannot start servers ({e}); each starts as its own process."
            )
            zygote.stop()
            return False
        return True

    def _fork(
        self, child: ChildServer, env: dict[str, str], root: str, fds: tuple[int, int, int]
    ) -> ForkedChild | None:
        """``child`` forked from the fork server with ``env`` (the numbers of ``fds`` in the child filled
        in), or None when the fork server failed to (then it is spawned, and so is every later child)."""
        zygote = self._zygote
        assert zygote is not None
        try:
            return zygote.spawn(
                str(child.script),
                root,
                env,
                fds,
                lambda numbers: {
                    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME: str(numbers[0]),
                    NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME: f"{numbers[1]},{numbers[2]}",
                },
                child.label,
                timeout=min(self.startup_timeout_s, HELLO_TIMEOUT_S),
            )
        except ZygoteUnavailable as e:
            self.echo(
                f"nemo_gym: the fork server cannot start servers ({e}); each starts as its own process."
            )
            zygote.stop()
            return None

    def _pump(self, child: ChildServer, log_file: IO[str] | None) -> None:
        assert child.process is not None and child.process.stdout is not None
        prefix = f"[{child.label}] "
        scrubber = process_scrubber()
        for raw in iter(child.process.stdout.readline, b""):
            line = scrubber.scrub(raw.decode(errors="replace").rstrip("\n"))
            child.tail.append(line)
            self._emit(prefix + line)
            if log_file is not None:
                log_file.write(line + "\n")
        if log_file is not None:
            log_file.close()


def _resolved(cfg: Any, key: str) -> Any:
    """The value of top-level ``key`` with every interpolation resolved (against the whole config)."""
    node = cfg._get_node(key)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else cfg[key]
