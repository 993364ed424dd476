"""The resources-session contract (NeMo Gym 0.7's environment-server seed and close, written out in
:mod:`nemo_gym.server.resources`), checked through a server's own routes from its tests. Upstream's path
``nemo_gym.testing.session_conformance`` faces this module."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from nemo_gym.server.resources import (
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
)


def check_resources_session_contract(
    app: FastAPI, seed: ResourcesSeedSessionRequest, *, keeps_state: bool
) -> None:
    """Seed twice, close twice, close an id never seeded, through ``app``; with ``keeps_state``, a seed after
    its close and a seed of the never-seeded id closed before it must both be refused (4xx/5xx). Raises
    AssertionError naming the step that broke the contract. ``seed`` must carry an id ``app`` has not seen."""
    from fastapi.testclient import TestClient  # needs httpx: a test-time import

    client = TestClient(app, raise_server_exceptions=False)

    def post(path: str, body: Any, step: str) -> Any:
        answer = client.post(path, json=body.model_dump(mode="json"))
        assert answer.status_code == 200, f"{step}: {path} answered {answer.status_code}: {answer.text[:500]}"
        return answer.json()

    session = seed.resources_session_id
    close = ResourcesCloseSessionRequest(resources_session_id=session, episode_id=seed.episode_id)
    for step in ("seed", "the same seed again"):
        seeded = ResourcesSeedSessionResponse.model_validate(post("/seed_session", seed, step))
        assert seeded.resources_session_id == session, (
            f"{step}: answered session {seeded.resources_session_id!r}"
        )
    for step in ("close", "the same close again"):
        closed = ResourcesCloseSessionResponse.model_validate(post("/close_session", close, step))
        assert closed.resources_session_id == session, (
            f"{step}: answered session {closed.resources_session_id!r}"
        )
    unseen = seed.model_copy(update={"resources_session_id": f"{session}-never-seeded"})
    post(
        "/close_session",
        ResourcesCloseSessionRequest(
            resources_session_id=unseen.resources_session_id, episode_id=seed.episode_id
        ),
        "close of a session never seeded",
    )
    if keeps_state:
        for late, what in (
            (seed, "a seed after its close"),
            (unseen, "a seed after a close that came first"),
        ):
            answer = client.post("/seed_session", json=late.model_dump(mode="json"))
            assert answer.status_code >= 400, (
                f"{what} created session {late.resources_session_id!r} again ({answer.status_code})"
            )
