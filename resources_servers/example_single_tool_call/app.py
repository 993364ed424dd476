"""example_single_tool_call: one tool (``get_weather``) and a verifier that checks the model used it.

Reward 1.0 iff the response contains a ``get_weather`` call for the task's ``expected_city``
(case-insensitive) and ends with an assistant message; otherwise 0.0.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
    function_calls,
)

CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")


class ExampleSingleToolCallConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = (
        ReverifyMode.STATELESS
    )  # verify reads only the row and the response


class GetWeatherRequest(BaseModel):
    city: str = Field(description="The city to get the weather for, e.g. 'Paris'.")


class GetWeatherResponse(BaseModel):
    city: str
    weather: str


class SingleToolCallVerifyRequest(BaseVerifyRequest):
    expected_city: str


class ExampleSingleToolCallServer(SimpleResourcesServer):
    config: ExampleSingleToolCallConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/get_weather")(self.get_weather)
        return app

    async def get_weather(self, body: GetWeatherRequest) -> GetWeatherResponse:
        # Deterministic per city, so rollouts are reproducible.
        digest = hashlib.sha256(body.city.strip().lower().encode()).digest()
        weather = f"{CONDITIONS[digest[0] % len(CONDITIONS)]}, {digest[1] % 35} degrees Celsius"
        return GetWeatherResponse(city=body.city, weather=weather)

    async def verify(self, body: SingleToolCallVerifyRequest) -> BaseVerifyResponse:
        expected = body.expected_city.strip().lower()
        called = False
        for call in function_calls(body.response, "get_weather"):
            try:
                city = str(orjson.loads(call.arguments).get("city", ""))
            except (orjson.JSONDecodeError, AttributeError):
                continue
            called = called or city.strip().lower() == expected
        last = body.response.output[-1] if body.response.output else None
        answered = last is not None and last.type == "message" and getattr(last, "role", None) == "assistant"
        return BaseVerifyResponse(**body.model_dump(), reward=1.0 if (called and answered) else 0.0)


if __name__ == "__main__":
    ExampleSingleToolCallServer.run_webserver()
