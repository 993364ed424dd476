"""gymnasium: any text-observation ``gymnasium.Env`` as a per-session environment behind a tool.

Contract
--------
* The config names the environments this server offers: ``envs: {<env_name>: {env_id, env_kwargs,
  max_episode_steps}}``. At start-up each is made once and checked: its action space must be
  ``Discrete`` and its observation must be text (``render_mode="ansi"`` is offered, or the observation
  space is ``Discrete`` / a ``Tuple`` of ``Discrete``). Anything else stops the server with an error
  naming the env and why (e.g. CartPole: Box observations, no ansi rendering).
* A task row carries ``env_name`` (one of the configured names) and an optional ``seed``.
  ``POST /reset`` starts the session's episode (``env.reset(seed=seed)``) and answers the first
  observation as text; ``info`` has ``env_id``, ``actions`` (names, in action-index order) and
  ``supports_explicit_close: true``.
* The model acts with the function tool ``take_action(action)`` (an action name such as ``"left"``,
  case-insensitive, or its index in ASCII digits), or by writing ``<action>NAME</action>`` in a message
  (one action: a message naming several different ones moves nothing and says so; tags are found in
  linear time, :func:`text_actions`). ``POST /step`` applies the turn's actions in order: every call
  gets a ``tool_outputs`` entry (the chosen action, the step reward and the new observation); a call
  after the episode ended, an action the env does not have, or arguments that are not a JSON object (or
  nest past the decoder's depth), change nothing and say so: nothing a model writes makes ``/step``
  fail. A turn with no action gets an observation asking for one.
* ``reward`` of a step is the sum of the env rewards it collected, so the agent's total is the episode
  return. ``terminated`` (the env reached a terminal state) and ``truncated`` (the env's time limit,
  ``max_episode_steps``) are reported exactly as Gymnasium returns them, never merged.
* Env instances are reused across episodes (``reset`` restarts them fully); new ones are made off the
  event loop. Live episodes are bounded by ``max_sessions`` (the oldest is dropped).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field, PrivateAttr

import gymnasium
from gymnasium import spaces
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseSeedSessionResponse
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from resources_servers.gymnasium.base import GymnasiumServer, extract_text

ACTION_TOOL = "take_action"
MAX_IDLE_ENVS = 256  # finished envs kept for reuse, per env_name

# Action names of the toy-text envs, in index order (Gymnasium's documented meanings).
KNOWN_ACTIONS: dict[str, list[str]] = {
    "FrozenLake": ["left", "down", "right", "up"],
    "FrozenLake8x8": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack": ["stick", "hit"],
}
_ANSI_HIGHLIGHT = re.compile(r"\x1b\[4[0-7](?:;\d+)*m(.*?)\x1b\[0m", re.S)
_ANSI_ANY = re.compile(r"\x1b\[[0-9;]*m")
_ACTION_OPEN = re.compile(r"<action>", re.I)
_ACTION_CLOSE = re.compile(r"</action>", re.I)
_ACTION_INDEX = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() is also true for '³'
MAX_SHOWN_ACTION_CHARS = 100  # of an invalid action, echoed back to the model
_TAXI_PLACES = ["R", "G", "Y", "B"]


class GymEnvConfig(BaseModel):
    env_id: str
    env_kwargs: dict[str, Any] = {}
    max_episode_steps: int | None = Field(default=None, ge=1)


class GymnasiumEnvServerConfig(BaseResourcesServerConfig):
    envs: dict[str, GymEnvConfig] = Field(min_length=1)
    max_sessions: int = Field(default=10_000, ge=1)


class GymRowRequest(BaseModel):
    """What a task row carries for this server (also published at ``/row_schema``)."""

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    env_name: str
    seed: int | None = None


class NotATextEnvError(ValueError):
    """The env cannot be played through text (non-discrete actions or no text observation)."""


def _base_name(env_id: str) -> str:
    return env_id.split("/")[-1].split("-v")[0]


def action_names(env_id: str, action_space: spaces.Discrete) -> list[str]:
    known = KNOWN_ACTIONS.get(_base_name(env_id))
    if known is not None and len(known) == int(action_space.n):
        return known
    return [str(i) for i in range(int(action_space.n))]


def make_env(cfg: GymEnvConfig) -> tuple[gymnasium.Env, bool]:
    """Make the env (``render_mode="ansi"`` when offered); returns it and whether it renders ansi.
    Raises :class:`NotATextEnvError` for an env that cannot be played as text."""
    kwargs: dict[str, Any] = {"disable_env_checker": True, **cfg.env_kwargs}
    if cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    env = gymnasium.make(cfg.env_id, **kwargs)
    modes = list(env.metadata.get("render_modes") or [])
    ansi = "ansi" in modes
    if ansi:
        env.close()
        env = gymnasium.make(cfg.env_id, render_mode="ansi", **kwargs)
    obs_space = env.observation_space
    discrete_obs = isinstance(obs_space, spaces.Discrete) or (
        isinstance(obs_space, spaces.Tuple) and all(isinstance(s, spaces.Discrete) for s in obs_space.spaces)
    )
    problems = []
    if not isinstance(env.action_space, spaces.Discrete):
        problems.append(f"its action space {env.action_space} is not Discrete")
    if not ansi and not discrete_obs:
        problems.append(
            f"it has no text observation (render modes {modes}, none of them 'ansi'; observation space "
            f"{obs_space} is not Discrete or a Tuple of Discrete)"
        )
    if problems:
        env.close()
        raise NotATextEnvError(f"{cfg.env_id} cannot be played as text: {'; '.join(problems)}")
    return env, ansi


def describe(env_id: str, env: gymnasium.Env, obs: Any, ansi: bool) -> str:
    """The observation as text: the ansi rendering (highlighted cell shown as ``[X]``) plus a plain
    description for the known envs, else the raw observation."""
    name = _base_name(env_id)
    lines = []
    if ansi:
        board = _ANSI_ANY.sub("", _ANSI_HIGHLIGHT.sub(lambda m: f"[{m.group(1)}]", env.render() or ""))
        lines.append(board.strip("\n"))
    unwrapped = env.unwrapped
    if name.startswith("FrozenLake"):
        ncol = int(unwrapped.ncol)
        lines.append(
            f"You are at row {int(obs) // ncol}, column {int(obs) % ncol} (marked [ ]). "
            "S start, F frozen, H hole, G goal."
        )
    elif name == "CliffWalking":
        lines.append(f"You are at row {int(obs) // 12}, column {int(obs) % 12} (x). C cliff, T target.")
    elif name == "Taxi":
        row, col, passenger, destination = unwrapped.decode(int(obs))
        where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_PLACES[passenger]}"
        lines.append(
            f"Taxi at row {row}, column {col}; passenger {where}; destination {_TAXI_PLACES[destination]}."
        )
    elif name == "Blackjack":
        player, dealer, usable_ace = (int(x) for x in obs)
        lines.append(
            f"Your hand totals {player} ({'with' if usable_ace else 'no'} usable ace); the dealer shows {dealer}."
        )
    else:
        lines.append(f"Observation: {obs!r}")
    return "\n".join(lines)


def text_actions(text: str, limit: int = 2) -> list[str]:
    """The different actions a message names in ``<action>NAME</action>`` tags (case-insensitive tags,
    the name stripped), in order, at most ``limit`` of them. Linear in the text: every tag is found once
    (a backtracking pattern took minutes on an unclosed tag followed by a few thousand spaces)."""
    closes = [m.start() for m in _ACTION_CLOSE.finditer(text)]
    found: list[str] = []
    after = 0  # the end of the last pair: a tag opened inside a pair is part of its name
    j = 0
    for opened in _ACTION_OPEN.finditer(text):
        if opened.start() < after:
            continue
        while j < len(closes) and closes[j] < opened.end():
            j += 1
        if j == len(closes):
            break
        name = text[opened.end() : closes[j]].strip()
        after = closes[j] + len("</action>")
        if name not in found:
            found.append(name)
            if len(found) >= limit:
                break
    return found


class _Episode:
    __slots__ = ("env_name", "env", "ansi", "actions", "return_", "steps", "done")

    def __init__(self, env_name: str, env: gymnasium.Env, ansi: bool, actions: list[str]) -> None:
        self.env_name, self.env, self.ansi, self.actions = env_name, env, ansi, actions
        self.return_, self.steps, self.done = 0.0, 0, False


class GymnasiumEnvServer(GymnasiumServer):
    config: GymnasiumEnvServerConfig

    _episodes: dict[str, _Episode] = PrivateAttr(default_factory=dict)
    _idle: dict[str, list[tuple[gymnasium.Env, bool]]] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        for env_name, cfg in self.config.envs.items():  # refuse a non-text env before serving anything
            try:
                self._idle.setdefault(env_name, []).append(make_env(cfg))
            except NotATextEnvError as e:
                raise NotATextEnvError(f"envs.{env_name}: {e}") from None
            except gymnasium.error.Error as e:
                raise ValueError(f"envs.{env_name}: cannot make {cfg.env_id!r}: {e}") from None

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/stats")(self.stats)
        return app

    async def stats(self) -> dict[str, Any]:
        """``GET /stats``: live episodes, idle (reusable) envs per env name, ``/close`` calls per reason."""
        return {
            "live_episodes": len(self._episodes),
            "idle_envs": {k: len(v) for k, v in self._idle.items()},
            "closed_by_reason": dict(self.closed_by_reason),
        }

    async def seed_session(self, body: GymRowRequest) -> BaseSeedSessionResponse:
        """Not used by gymnasium_agent (it calls /reset); declares the row's fields for /row_schema."""
        return BaseSeedSessionResponse()

    async def _env(self, env_name: str) -> tuple[gymnasium.Env, bool]:
        idle = self._idle.get(env_name)
        if idle:
            return idle.pop()
        return await asyncio.to_thread(make_env, self.config.envs[env_name])

    async def reset(self, metadata: dict[str, Any], session_id: str | None = None) -> tuple[str | None, dict]:
        env_name, seed = metadata.get("env_name"), metadata.get("seed")
        if env_name not in self.config.envs:
            raise HTTPException(422, f"env_name: {env_name!r} is not one of {sorted(self.config.envs)}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise HTTPException(422, f"seed: must be an integer or null, got {seed!r}")
        await self.close_session(session_id)
        env, ansi = await self._env(env_name)
        cfg = self.config.envs[env_name]
        episode = _Episode(env_name, env, ansi, action_names(cfg.env_id, env.action_space))
        obs, _info = env.reset(seed=seed)
        self._episodes[session_id] = episode
        while len(self._episodes) > self.config.max_sessions:
            await self.close_session(next(iter(self._episodes)))
        text = describe(cfg.env_id, env, obs, ansi)
        info = {"env_id": cfg.env_id, "actions": episode.actions, "supports_explicit_close": True}
        return f"{text}\nActions: {', '.join(episode.actions)}.", info

    def _parse_action(self, episode: _Episode, raw: Any) -> int | None:
        value = str(raw).strip().strip("'\"").lower()
        if value in episode.actions:
            return episode.actions.index(value)
        if _ACTION_INDEX.fullmatch(value) and int(value) < len(episode.actions):
            return int(value)
        return None

    def _act(self, episode: _Episode, raw: Any) -> tuple[str, float, bool, bool]:
        """Apply one action; returns (text, reward, terminated, truncated)."""
        if episode.done:
            return "The episode is over; this action was not applied.", 0.0, False, False
        index = self._parse_action(episode, raw)
        if index is None:
            shown = repr(raw)
            if len(shown) > MAX_SHOWN_ACTION_CHARS:
                shown = shown[:MAX_SHOWN_ACTION_CHARS] + f"... ({len(shown):,} characters)"
            return (
                f"Error: {shown} is not an action here. Choose one of: {', '.join(episode.actions)} "
                f"(or its index 0-{len(episode.actions) - 1}).",
                0.0,
                False,
                False,
            )
        obs, reward, terminated, truncated, _info = episode.env.step(index)
        reward = float(reward)
        episode.steps += 1
        episode.return_ += reward
        cfg = self.config.envs[episode.env_name]
        text = (
            f"Action: {episode.actions[index]}. Reward: {reward:g}. Return so far: {episode.return_:g}.\n"
            f"{describe(cfg.env_id, episode.env, obs, episode.ansi)}"
        )
        if terminated:
            text += "\nThe episode has ended (terminal state)."
            episode.done = True
        elif truncated:
            text += "\nThe episode has ended (step limit reached)."
            episode.done = True
        return text, reward, bool(terminated), bool(truncated)

    async def step(
        self, action: NeMoGymResponse, metadata: dict[str, Any], session_id: str | None = None
    ) -> tuple[str | None, float, bool, bool, dict]:
        episode = self._episodes.get(session_id)
        if episode is None:
            raise HTTPException(
                409, "This session has no episode: call /reset first (with its cookie), or the episode ended."
            )
        reward, terminated, truncated = 0.0, False, False
        tool_outputs: list[dict[str, str]] = []
        acted = False
        for item in action.output:
            if item.type != "function_call":
                continue
            acted = True
            if item.name != ACTION_TOOL:
                text = f"Error: unknown tool {item.name!r}; the only tool is {ACTION_TOOL}(action)."
            else:
                try:
                    raw = json.loads(item.arguments or "{}").get("action")
                except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, too deep
                    raw = None
                if raw is None:
                    text = f'Error: call {ACTION_TOOL} with arguments {{"action": "<name>"}}.'
                else:
                    text, r, term, trunc = self._act(episode, raw)
                    reward += r
                    terminated, truncated = terminated or term, truncated or trunc
            tool_outputs.append(self.tool_output(item, text))
        observation = None
        if not acted:
            actions = text_actions(extract_text(action))
            if len(actions) == 1:
                observation, reward, terminated, truncated = self._act(episode, actions[0])
            elif actions:
                observation = (
                    f"No action taken: this message names {len(actions)} different actions in <action> tags "
                    f"({', '.join(repr(a[:MAX_SHOWN_ACTION_CHARS]) for a in actions)}). Write one "
                    f"<action>NAME</action> per turn, or call {ACTION_TOOL} once for each move."
                )
            else:
                observation = (
                    f"No action taken. Call {ACTION_TOOL} with one of: {', '.join(episode.actions)} "
                    "(or write <action>NAME</action>)."
                )
        info = {
            "tool_outputs": tool_outputs,
            "episode_return": episode.return_,
            "episode_steps": episode.steps,
        }
        return observation, reward, terminated, truncated, info

    async def close_session(self, session_id: str | None) -> None:
        episode = self._episodes.pop(session_id, None)
        if episode is None:
            return
        idle = self._idle.setdefault(episode.env_name, [])
        if len(idle) < MAX_IDLE_ENVS:
            idle.append((episode.env, episode.ansi))
        else:
            episode.env.close()


if __name__ == "__main__":
    GymnasiumEnvServer.run_webserver()
