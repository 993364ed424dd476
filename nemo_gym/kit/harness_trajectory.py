"""Training samples from the model calls an external agent harness made during one rollout.

A harness (any program pointed at a model server's base URL) sends each request with its whole
conversation so far; the model server answers with the prompt's token ids, the generated token ids and
their log-probabilities (local_model and vllm_model; the scripted model's fake ids behave the same way),
and records each call of the rollout (:mod:`nemo_gym.server.model_calls`). This module turns those
recorded calls into what a trainer consumes.

Contract
--------
* :func:`call_tokens` reads one recorded call's ids from its answer, whatever API it came through:
  ``/v1/chat/completions`` (the first choice's message), ``/v1/responses`` (the output item that
  carries them) or ``/v1/messages`` (the answer's own ``prompt_token_ids`` / ``generation_token_ids``
  / ``generation_log_probs``). A call without them (a failed call, a server that returns none) gives
  ``None``.
* :func:`merge_samples` makes one sample per run of calls that extend each other: a call whose prompt
  starts with the previous sample's whole sequence (its prompt and every generation so far) adds only
  the new prompt tokens (loss mask 0) and its generation (loss mask 1) to that sample. A call whose
  prompt does not (the harness truncated, summarised or rewrote its history) starts a new sample marked
  ``rewrote_history``; a call without ids starts none and is listed under ``calls_without_token_ids``.
  Log-probabilities line up with ``token_ids`` (0.0 where the mask is 0). Each sample lists the
  ``policy_versions`` its calls were answered with (:mod:`nemo_gym.server.policy_version`; empty until a
  trainer sets one), and :func:`policy_versions_of_calls` gives the rollout's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids")


@dataclass(frozen=True)
class CallTokens:
    """The token ids of one model call (``log_probs`` aligned with ``generation_ids``, or None)."""

    call_index: int
    prompt_ids: list[int]
    generation_ids: list[int]
    log_probs: list[float] | None


def _carrier(answer: Any) -> dict[str, Any] | None:
    """The object of a model answer that holds its token ids, per API."""
    if not isinstance(answer, dict):
        return None
    if all(k in answer for k in TOKEN_FIELDS):  # /v1/messages, or any answer carrying them on top
        return answer
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):  # /v1/chat/completions
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    output = answer.get("output")
    if isinstance(output, list):  # /v1/responses: the last item that carries them
        for item in reversed(output):
            if isinstance(item, dict) and item.get("generation_token_ids") is not None:
                return item
    return None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def call_tokens(call: dict[str, Any]) -> CallTokens | None:
    """The token ids of one recorded call (see the module docstring); None when it has none."""
    status = call.get("status_code")
    if status is not None and status >= 400:
        return None
    carrier = _carrier(call.get("response"))
    if carrier is None:
        return None
    prompt, generation = _ids(carrier.get("prompt_token_ids")), _ids(carrier.get("generation_token_ids"))
    if prompt is None or generation is None:
        return None
    log_probs = carrier.get("generation_log_probs")
    if not (isinstance(log_probs, list) and len(log_probs) == len(generation)):
        log_probs = None
    return CallTokens(int(call.get("call_index", 0)), prompt, generation, log_probs)


def merge_samples(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The training samples of one rollout's recorded calls, in call order (see the module docstring):
    ``{"samples": [...], "calls_without_token_ids": [call_index, ...]}``; each sample has ``token_ids``,
    ``loss_mask``, ``log_probs``, ``call_indices``, ``prompt_length`` (its first prompt) and
    ``rewrote_history``."""
    samples: list[dict[str, Any]] = []
    without: list[int] = []
    current: dict[str, Any] | None = None
    for call in sorted(calls, key=lambda c: int(c.get("call_index", 0))):
        tokens = call_tokens(call)
        if tokens is None:
            without.append(int(call.get("call_index", 0)))
            continue
        generation_lp = tokens.log_probs or [0.0] * len(tokens.generation_ids)
        if current is not None and tokens.prompt_ids[: len(current["token_ids"])] == current["token_ids"]:
            tail = tokens.prompt_ids[len(current["token_ids"]) :]
            current["token_ids"] += tail + tokens.generation_ids
            current["loss_mask"] += [0] * len(tail) + [1] * len(tokens.generation_ids)
            current["log_probs"] += [0.0] * len(tail) + generation_lp
            current["call_indices"].append(tokens.call_index)
            _add_version(current["policy_versions"], call)
            continue
        current = {
            "token_ids": tokens.prompt_ids + tokens.generation_ids,
            "loss_mask": [0] * len(tokens.prompt_ids) + [1] * len(tokens.generation_ids),
            "log_probs": [0.0] * len(tokens.prompt_ids) + generation_lp,
            "call_indices": [tokens.call_index],
            "prompt_length": len(tokens.prompt_ids),
            "rewrote_history": bool(samples),
            "policy_versions": [],
        }
        _add_version(current["policy_versions"], call)
        samples.append(current)
    return {"samples": samples, "calls_without_token_ids": without}


def _add_version(versions: list[Any], call: dict[str, Any]) -> None:
    value = call.get("policy_version")
    if value is not None and value not in versions:
        versions.append(value)


def policy_versions_of_calls(calls: list[dict[str, Any]]) -> list[Any]:
    """The distinct policy versions a rollout's recorded calls were answered with, in call order."""
    versions: list[Any] = []
    for call in sorted(calls, key=lambda c: int(c.get("call_index", 0))):
        _add_version(versions, call)
    return versions
