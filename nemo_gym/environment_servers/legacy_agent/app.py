"""legacy_agent: an environment server in front of an agent that runs whole rollouts through its ``/run``.

The episode is the agent's: this server sends the agent the body of each ``/run`` unchanged (its headers
too, except those of the connection, the caller's credentials and cookies, which go as cookies) and
answers with the agent's answer unchanged (status, body, headers, every ``Set-Cookie``). Unlike
upstream's relay, which accepts the episode bounds and ignores them, this one applies them: at most
``max_concurrent_episodes`` calls at once (a caller waits at most ``queue_timeout_seconds`` for a place,
then gets a 503 naming the setting), each at most ``default_episode_timeout_seconds`` (then a 504 naming
the agent): an agent that hangs holds nothing forever. ``/aggregate_metrics`` is the agent's.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from fastapi import FastAPI, Request, Response

from nemo_gym.config.types import AgentServerRef, AggregateMetrics, AggregateMetricsRequest
from nemo_gym.errors import error_envelope, raise_for_status, response_body
from nemo_gym.server.environment import BaseEnvironmentServer, BaseEnvironmentServerConfig, CleanupContext
from nemo_gym.server.episodes import BaseEpisodeRequest, BaseEpisodeResponse

# Headers about the connection or the body's framing (each hop sets its own), the caller's credential
# (this server sends its own) and cookies (sent as cookies, so not twice).
_NOT_RELAYED = frozenset(
    {
        "authorization",
        "connection",
        "content-encoding",
        "content-length",
        "cookie",
        "host",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def _relayed(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _NOT_RELAYED]


class LegacyAgentEnvironmentServerConfig(BaseEnvironmentServerConfig):
    agent_server: AgentServerRef


class LegacyAgentEnvironmentServer(BaseEnvironmentServer):
    """``/run`` relayed to one agent, within the episode bounds."""

    config: LegacyAgentEnvironmentServerConfig
    request_model = BaseEpisodeRequest
    response_model = BaseEpisodeResponse

    def setup_webserver(self) -> FastAPI:
        app = super(BaseEnvironmentServer, self).setup_webserver()  # the base app, without the typed /run
        app.post("/run")(self.relay_run)
        app.post("/aggregate_metrics")(self.relay_aggregate_metrics)
        return app

    async def run(self, request: BaseEpisodeRequest, cleanup: CleanupContext) -> BaseEpisodeResponse:
        raise NotImplementedError("legacy_agent relays /run to its agent; it has no typed episode")

    async def relay_aggregate_metrics(self, body: AggregateMetricsRequest) -> AggregateMetrics:
        agent = self.config.agent_server.name
        resp = await self.server_client.post(agent, "/aggregate_metrics", json=body.model_dump(mode="json"))
        raise_for_status(resp, agent, "/aggregate_metrics")
        return AggregateMetrics.model_validate_json(response_body(resp))

    async def relay_run(self, request: Request) -> Response:
        async with self.episode_slot() as refused:
            if refused is not None:
                body = error_envelope("overloaded", server=self.config.name, path="/run", message=refused)
                return Response(orjson.dumps(body), status_code=503, media_type="application/json")
            upstream = await self.server_client.post(
                self.config.agent_server.name,
                "/run",
                data=await request.body(),
                headers=dict(_relayed(request.headers.items())),
                cookies=dict(request.cookies),
                timeout_s=self.config.episode_timeout_s,
                timeout_setting=f"{self.config.name}.default_episode_timeout_seconds",
            )
        body = response_body(upstream)
        response = Response(content=body, status_code=upstream.status)
        # raw_headers, so that repeated headers (Set-Cookie) all reach the caller.
        response.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in _relayed(upstream.headers.items())
        ] + [(b"content-length", str(len(body)).encode())]
        return response


if __name__ == "__main__":
    LegacyAgentEnvironmentServer.run_webserver()
