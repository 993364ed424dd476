"""Any Aviary environment over HTTP: a resources server whose envs live in Aviary's ``TaskDatasetServer``.

Contract
--------
* The HTTP contract is :class:`~resources_servers.aviary.app.AviaryResourcesServer`'s, unchanged
  (``/seed_session {task_idx}``, ``/step``, ``/verify``, ``/close``, ``/env_stats``, bounds and errors),
  so ``aviary_agent`` and task rows work as with the in-process servers. Only the env is remote: it is
  Aviary's own ``TaskEnvironmentClient`` (``/start`` + ``/reset``, ``/step``, ``/close`` on the
  task-dataset server at ``dataset_server_url``), so the base server's bounds, timeouts and
  conversions apply to it as to any env.
* Every request to the remote carries ``X-API-Key: <dataset_server_api_key>`` (a secret-named key: set
  it from ``env.yaml``; it is redacted and scrubbed like every secret) and is bounded by
  ``request_timeout_s`` (proxy variables of the environment are not used: the URL is reached directly).
* The remote failing is an infrastructure error, never a reward: unreachable or any other error status -> 502,
  refusing our API key (401/403) -> 502 saying so, no answer within ``request_timeout_s`` -> 504. A
  404 for an env (the remote restarted or dropped it) is our 404 for an unknown ``env_id``; closing an
  env the remote no longer has is a success. The remote's answers are quoted at most
  ``_DETAIL_CHARS`` characters long. One status is the model's doing, not the remote's: a 500 on
  ``/step`` is how Aviary's server answers an env raising inside ``step()`` (e.g. a tool called without
  its argument), so the model reads the exception as its tool error, as with the in-process servers.
* ``local_task_dataset: gsm8k|hotpotqa`` (instead of ``dataset_server_url``) starts Aviary's
  TaskDatasetServer for that file of this folder as a child process (:class:`LocalTaskDatasetServer`),
  for trying the remote path and for ``ng_reward_audit``.
* ``task_idx`` bounds come from the remote's ``GET /info`` (``dataset_size``), read at start and, if the
  remote was not up then, at the first ``/seed_session``; a remote with no size lets every index through
  to the remote (which then answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, Literal

import httpx
from fastapi import HTTPException, Request
from pydantic import Field, PrivateAttr, SecretStr, model_validator

from aviary.core import TaskDataset
from aviary.env_client import TaskEnvironmentClient
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from resources_servers.aviary.app import AviaryResourcesServer
from resources_servers.aviary.schemas import (
    AviaryResourcesServerConfig,
    AviarySeedSessionRequest,
    AviarySeedSessionResponse,
)

logger = logging.getLogger(__name__)

_DETAIL_CHARS = 600


class RemoteAviaryResourcesServerConfig(AviaryResourcesServerConfig):
    dataset_server_url: str | None = Field(
        default=None,
        description="Base URL of a running Aviary TaskDatasetServer (e.g. http://127.0.0.1:8041).",
    )
    local_task_dataset: Literal["gsm8k", "hotpotqa"] | None = Field(
        default=None,
        description="Instead of dataset_server_url: start Aviary's TaskDatasetServer for this folder's "
        "GSM8K or HotPotQA file as a child process on 127.0.0.1 (a free port, a fresh API key), for trying "
        "the remote path and for ng_reward_audit; it stops with this server.",
    )
    dataset_server_api_key: SecretStr | None = Field(
        default=None,
        description="The task-dataset server's API key (its X-API-Key header); None when it has none. "
        "Set it from env.yaml (`${aviary_dataset_server_api_key}`): it is a secret.",
    )
    request_timeout_s: float = Field(
        default=120.0, gt=0, description="Bound on each HTTP request to the task-dataset server."
    )

    @model_validator(mode="after")
    def _one_remote(self) -> RemoteAviaryResourcesServerConfig:
        if (self.dataset_server_url is None) == (self.local_task_dataset is None):
            raise ValueError(
                "give exactly one of dataset_server_url (a running TaskDatasetServer) and "
                "local_task_dataset (gsm8k or hotpotqa: one started by this server)"
            )
        return self


class RemoteCallError(HTTPException):
    """The task-dataset server failed a request (an infrastructure error, answered as such)."""


class RemoteEnvStepError(RuntimeError):
    """The remote env raised inside ``step()`` on the model's action (Aviary's server answers it with a 500
    and the exception): the model's tool error, as for an in-process env, never an infrastructure error."""


class RemoteEnv(TaskEnvironmentClient):
    """Aviary's ``TaskEnvironmentClient`` over a shared, bounded HTTP client, with the remote's failures
    turned into our HTTP errors (see the module docstring)."""

    def __init__(self, idx: int, base_url: str, client: httpx.AsyncClient, api_key: str | None):
        super().__init__(idx=idx, base_url=base_url, api_key=api_key)
        self._client = client
        self._base_url = base_url

    async def _post(self, url: str, json: Mapping[str, Any]) -> httpx.Response:
        headers = {"X-API-Key": self._api_key} if self._api_key else {}
        path = url[len(self._base_url) :] or url
        return await remote_call(self._client, "POST", url, path, self._base_url, json=json, headers=headers)

    async def close(self) -> None:
        try:
            await super().close()
        except RemoteCallError as e:
            if e.status_code != 404:
                raise
            logger.info("the task-dataset server no longer had env %s", getattr(self, "state", None))


async def remote_call(
    client: httpx.AsyncClient, method: str, url: str, path: str, base_url: str, **kwargs: Any
) -> httpx.Response:
    """One request to the task-dataset server, its failures raised as :class:`RemoteCallError`."""
    where = f"the Aviary task-dataset server at {base_url}"
    try:
        resp = await client.request(method, url, **kwargs)
    except httpx.TimeoutException:
        raise RemoteCallError(504, f"{where} did not answer {path} within the request timeout") from None
    except httpx.HTTPError as e:
        raise RemoteCallError(
            502, f"{where} could not be reached for {path}: {type(e).__name__}: {e}"
        ) from None
    if resp.is_success:
        return resp
    body = resp.text[:_DETAIL_CHARS]
    if resp.status_code in (401, 403):
        raise RemoteCallError(
            502,
            f"{where} refused our API key on {path} (HTTP {resp.status_code}: {body}): check "
            "dataset_server_api_key (env.yaml) against the server's api_key",
        )
    if resp.status_code == 404 and path != "/info":
        raise RemoteCallError(
            404, f"{where} does not know this env ({path}: {body}); it may have restarted: seed a new session"
        )
    if resp.status_code == 500 and path == "/step":
        # Aviary's TaskDatasetServer answers an env raising inside step() so: 500, detail = the traceback
        # and then repr(exception). What the model's action made the env raise is shown to the model.
        raise RemoteEnvStepError(_exception_of(resp))
    raise RemoteCallError(502, f"{where} answered {path} with HTTP {resp.status_code}: {body}")


def _exception_of(resp: httpx.Response) -> str:
    """The exception an Aviary task-dataset server's 500 names (the last line of its detail)."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    text = detail if isinstance(detail, str) else resp.text
    last = text.strip().splitlines()[-1] if text.strip() else "an error"
    return last[:_DETAIL_CHARS]


class LocalTaskDatasetServer:
    """Aviary's TaskDatasetServer for a local dataset of this folder, in a child process
    (``python -m resources_servers.aviary.serve_task_dataset``) on a free port of 127.0.0.1 with a fresh
    API key, a small environment (none of this server's variables) and ``PR_SET_PDEATHSIG``."""

    def __init__(self, dataset: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.api_key = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        keep = ("PATH", "LANG", "LC_ALL", "TZ", "VIRTUAL_ENV")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(
            PYTHONPATH=str(PACKAGE_PARENT_DIR),
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            AVIARY_DATASET_SERVER_API_KEY=self.api_key,
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "resources_servers.aviary.serve_task_dataset",
                dataset,
                "--port",
                str(self.port),
            ],
            cwd=str(PACKAGE_PARENT_DIR),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RemoteTaskDataset(TaskDataset[RemoteEnv]):
    """The remote's dataset: envs are :class:`RemoteEnv`; the size is read from ``GET /info``."""

    def __init__(self, config: RemoteAviaryResourcesServerConfig):
        self.local: LocalTaskDatasetServer | None = None
        if config.local_task_dataset is not None:
            self.local = LocalTaskDatasetServer(config.local_task_dataset)
            self.base_url, self.api_key = self.local.url, self.local.api_key
        else:
            self.base_url = str(config.dataset_server_url).rstrip("/")
            key = config.dataset_server_api_key
            self.api_key = key.get_secret_value() if key is not None else None
        self.timeout = config.request_timeout_s
        # About one request in flight per live env (the base server steps an env under its lock).
        self.limits = httpx.Limits(
            max_connections=config.max_live_envs + 4, max_keepalive_connections=config.max_live_envs + 4
        )
        self.size: int | None = None
        self.size_known = False
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=self.limits, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def fetch_size(self) -> None:
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        resp = await remote_call(
            self.client(), "GET", self.base_url + "/info", "/info", self.base_url, headers=headers
        )
        try:
            info = resp.json()
            size = info["dataset_size"]
        except (ValueError, TypeError, KeyError):
            raise RemoteCallError(
                502,
                f"{self.base_url}/info answered {resp.text[:_DETAIL_CHARS]!r}, not an Aviary TaskDatasetServer's "
                "{dataset_size, running_env_ids}: check dataset_server_url",
            ) from None
        self.size = size if isinstance(size, int) else None
        self.size_known = True

    def __len__(self) -> int:
        # A remote that does not say its size: every index goes to the remote, which answers.
        return sys.maxsize if self.size is None else self.size

    def get_new_env_by_idx(self, idx: int) -> RemoteEnv:
        return RemoteEnv(idx, self.base_url, self.client(), self.api_key)


class RemoteAviaryResourcesServer(AviaryResourcesServer[RemoteEnv, RemoteTaskDataset]):
    config: RemoteAviaryResourcesServerConfig
    dataset: RemoteTaskDataset = Field(default_factory=lambda data: RemoteTaskDataset(data["config"]))

    _size_lock: asyncio.Lock = PrivateAttr(default_factory=asyncio.Lock)

    async def on_startup(self) -> None:
        await super().on_startup()
        # A local task-dataset server (local_task_dataset) is starting with us: wait for it (bounded).
        tries = 120 if self.dataset.local is not None else 1
        for attempt in range(tries):
            try:
                await self.dataset.fetch_size()
                return
            except HTTPException as e:
                if attempt == tries - 1:
                    # Not fatal: the remote may start after us; /seed_session asks again (and answers this).
                    logger.warning("could not read the task-dataset server's size at start: %s", e.detail)
                else:
                    await asyncio.sleep(0.25)

    async def on_shutdown(self) -> None:
        await super().on_shutdown()  # closes every live env on the remote first
        await self.dataset.aclose()
        if self.dataset.local is not None:
            await asyncio.to_thread(self.dataset.local.stop)

    async def seed_session(
        self, request: Request, body: AviarySeedSessionRequest
    ) -> AviarySeedSessionResponse:
        if not self.dataset.size_known:
            async with self._size_lock:
                if not self.dataset.size_known:
                    await self.dataset.fetch_size()
        return await super().seed_session(request, body)


if __name__ == "__main__":
    RemoteAviaryResourcesServer.run_webserver()
