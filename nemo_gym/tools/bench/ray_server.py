"""A CPU-bound variant of example_single_tool_call for the replica benchmark (:mod:`nemo_gym.tools.bench.ray`).

Its ``verify`` burns ``verify_work_ms`` of CPU inline in the server process (a stand-in for an
environment whose scoring runs in the server itself), then scores as example_single_tool_call does,
so throughput is bound by the resources server's CPU and grows with its replicas. Started through
the ``entrypoint`` key of an ``example_single_tool_call`` block; not an environment to train on.
"""

from __future__ import annotations

import time

from pydantic import Field

from nemo_gym.server.resources import BaseVerifyResponse
from resources_servers.example_single_tool_call.app import (
    ExampleSingleToolCallConfig,
    ExampleSingleToolCallServer,
    SingleToolCallVerifyRequest,
)


def burn_cpu(work_ms: float) -> None:
    """About ``work_ms`` of this process's CPU time in a pure-Python loop."""
    end = time.process_time() + work_ms / 1000.0
    while time.process_time() < end:
        sum(i * i for i in range(200))


class CpuBoundConfig(ExampleSingleToolCallConfig):
    verify_work_ms: float = Field(default=20.0, ge=0)


class CpuBoundServer(ExampleSingleToolCallServer):
    config: CpuBoundConfig

    async def verify(self, body: SingleToolCallVerifyRequest) -> BaseVerifyResponse:
        burn_cpu(self.config.verify_work_ms)  # deliberately on the event loop: the server's CPU is the bound
        return await super().verify(body)


if __name__ == "__main__":
    CpuBoundServer.run_webserver()
