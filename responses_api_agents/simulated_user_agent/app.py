"""simulated_user_agent: a multi-turn conversation between the policy and a simulated user.

Contract
--------
* The row is a task row plus ``user_persona`` (the simulated user's instructions: who they are, what
  they want, when they are satisfied). ``POST /run``: ``/seed_session`` with the row, then up to
  ``max_turns`` rounds of {the user speaks -> the policy answers, running its tool calls against the
  resources server exactly like simple_agent, at most ``max_steps`` model calls per round}, then
  ``/verify`` with the whole conversation as ``response``.
* The user is another model server (``user_model_server``; it may be the same instance as the
  policy's). It sees ``user_persona`` + the rules below as its system prompt and the conversation
  from its side: its own earlier messages as assistant turns, the policy's visible text as user
  turns (tool calls and results are not shown to it). If the row's input already ends with a user
  message, that is the user's first message; otherwise the simulator writes it.
* The user ends the conversation by putting ``done_marker`` (default ``###DONE###``) in a message:
  the text before it (if any) is kept as the user's last message and the policy is not called
  again. Otherwise the conversation ends after ``max_turns`` policy answers.
* ``response.output`` holds, in order, every user message (``{"type": "message", "role": "user"}``)
  and every policy output item (messages, reasoning, function calls and their outputs). The answer is
  the row laid over with the verify response plus ``num_user_turns``, ``ended_by`` (``"user_done"``
  or ``"max_turns"``) and ``user_usage`` (the simulator's token usage, kept apart from the policy's
  in ``response.usage``).
* A simulator answer with no text, or a failure to reach any server, fails the rollout (a non-2xx
  naming the server), never a reward.
* When the caller of ``/run`` disconnects, the conversation is cancelled at once, whatever it waits
  on (the policy, the simulator, a tool; :mod:`nemo_gym.server.disconnect`): no model is called for a rollout
  nobody will read. (The resources server's session has no close call; its own bounds drop it.)
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.config_types import ModelServerRef
from nemo_gym.errors import UpstreamError
from nemo_gym.openai_utils import text_of_message
from nemo_gym.server.agent import add_usage, empty_usage
from nemo_gym.server.base import validated_body
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

DEFAULT_DONE_MARKER = "###DONE###"
USER_RULES = (
    "You are role-playing the user in a conversation with an AI assistant. Stay in character, write only "
    "what the user says (short, natural messages), and never do the assistant's work. When your goal is "
    "met, or the assistant cannot help, write {marker} to end the conversation."
)
KICKOFF = "(The conversation starts. Write your first message to the assistant.)"


class SimulatedUserAgentConfig(SimpleAgentConfig):
    user_model_server: ModelServerRef
    max_turns: int = Field(default=5, ge=1)  # policy answers per conversation
    done_marker: str = Field(default=DEFAULT_DONE_MARKER, min_length=1)
    # Extra Responses API parameters for the simulator's requests (e.g. temperature, max_output_tokens).
    user_model_params: dict[str, Any] = {}


class SimulatedUserRunRequest(BaseRunRequest):
    user_persona: str = Field(min_length=1)


def _visible_text(items: list[dict[str, Any]]) -> str:
    """What the user sees of a policy turn: the text of its assistant messages."""
    texts = [
        text_of_message(item)
        for item in items
        if item.get("type", "message") == "message" and item.get("role", "assistant") == "assistant"
    ]
    return "\n".join(t for t in texts if t)


class SimulatedUserAgent(SimpleAgent):
    config: SimulatedUserAgentConfig

    async def run(self, request: Request) -> Response:
        row = await validated_body(request, SimulatedUserRunRequest)
        return await self.answer_until_disconnected(request, self._conversation(row, dict(request.cookies)))

    async def _conversation(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)

        params = dict(row["responses_create_params"])
        raw = params.get("input", [])
        prefix = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        # The simulator's view: its own messages as "assistant", the policy's text as "user".
        user_view: list[dict[str, Any]] = [
            {"role": "system", "content": f"{row['user_persona']}\n\n{self._rules()}"},
            {"role": "user", "content": KICKOFF},
        ]
        conversation: list[dict[str, Any]] = []  # everything after the row's input, in order
        user_usage = empty_usage()
        policy_usage = empty_usage()
        ended_by = "max_turns"
        last_response: dict[str, Any] = {}
        # With observability_enabled, policy and simulator calls carry /ng-rollout/<id> (both captured).
        model_path = self.url_path_for_run("/v1/responses", row)

        if prefix and prefix[-1].get("role") == "user":
            user_view.append({"role": "assistant", "content": text_of_message(prefix[-1])})
        else:
            opening, done = await self._user_says(user_view, user_usage, cookies, model_path)
            if done and not opening:
                raise UpstreamError(
                    self.config.user_model_server.name,
                    "/v1/responses",
                    200,
                    "the simulated user ended the conversation before saying anything",
                    kind="bad_response",
                )
            conversation.append({"type": "message", "role": "user", "content": opening})
            if done:
                ended_by = "user_done"

        turns = 0
        while ended_by != "user_done" and turns < self.config.max_turns:
            policy_params = {**params, "input": prefix + conversation}
            response, cookies = await self.run_loop(policy_params, cookies, model_path)
            turns += 1
            last_response = response
            new_items = response.get("output") or []
            conversation.extend(new_items)
            add_usage(policy_usage, response.get("usage"))
            if turns >= self.config.max_turns:
                break
            user_view.append({"role": "user", "content": _visible_text(new_items) or "(no answer)"})
            message, done = await self._user_says(user_view, user_usage, cookies, model_path)
            if message:
                conversation.append({"type": "message", "role": "user", "content": message})
            if done:
                ended_by = "user_done"

        full = {**last_response, "output": conversation, "usage": policy_usage}
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json={**row, "response": full},
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        extra = {
            "num_user_turns": sum(1 for i in conversation if i.get("role") == "user"),
            "num_policy_turns": turns,
            "ended_by": ended_by,
            "user_usage": user_usage,
        }
        return {**row, **verify, **extra}

    def _rules(self) -> str:
        return USER_RULES.format(marker=self.config.done_marker)

    async def _user_says(
        self,
        user_view: list[dict[str, Any]],
        usage: dict[str, Any],
        cookies: dict[str, str],
        model_path: str = "/v1/responses",
    ) -> tuple[str, bool]:
        """One simulator turn: (message without the done marker, whether the user is done). The
        simulator's message is appended to ``user_view``."""
        name = self.config.user_model_server.name
        body = {**self.config.user_model_params, "input": user_view}
        response, _ = await self.server_client.post_json(
            name, model_path, json=body, cookies={}, **self.timeout("model_timeout_s")
        )
        add_usage(usage, response.get("usage"))
        text = _visible_text(response.get("output") or []).strip()
        if not text:
            raise UpstreamError(
                name, "/v1/responses", 200, "the simulated user answered with no text", kind="bad_response"
            )
        user_view.append({"role": "assistant", "content": text})
        marker = self.config.done_marker
        if marker in text:
            return text.split(marker, 1)[0].strip(), True
        return text, False


if __name__ == "__main__":
    SimulatedUserAgent.run_webserver()
