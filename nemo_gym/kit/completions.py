"""The legacy OpenAI Completions API (``POST /v1/completions``): request checks and answer shapes.

Contract
--------
* :func:`parse_prompts` accepts the four shapes the API allows for ``prompt`` (a string, a list of
  strings, a list of token ids, a list of lists of token ids) and returns one entry per prompt: a
  string or a list of ints. Anything else is a :class:`CompletionsRequestError` naming the field
  (``prompt``, ``prompt[2]``, ``prompt[1][5]``) and the bad value.
* :func:`check_vocabulary` refuses token ids outside ``[0, n_vocab)``, naming the field and the id.
* :func:`parse_stop` accepts ``stop`` as a string or a list of up to 4 strings (the API's limit).
* :func:`logprobs_block` builds a choice's ``logprobs`` (``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``, character offsets into the choice's ``text``);
  :func:`completion_answer` the ``text_completion`` object. The training fields of a choice use the
  names of the Responses items: ``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs`` (see ``docs/model_servers.md``).
"""

from __future__ import annotations

import codecs
import time
from typing import Any

from nemo_gym.openai_utils.responses import new_id

MAX_STOP_SEQUENCES = 4
DEFAULT_MAX_TOKENS = 16  # the API's default when max_tokens is left out


class CompletionsRequestError(ValueError):
    """A ``/v1/completions`` request the server cannot take; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"`{field}`: {message}")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(ids: list[Any], field: str) -> list[int]:
    for i, t in enumerate(ids):
        if not _is_id(t):
            raise CompletionsRequestError(f"{field}[{i}]", f"a token id must be an integer, got {t!r}")
        if t < 0:
            raise CompletionsRequestError(f"{field}[{i}]", f"token id {t} is negative")
    return list(ids)


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """One entry per prompt: a string, or a list of token ids (see the module docstring)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise CompletionsRequestError(
            "prompt",
            "must be a string, a list of strings, a list of token ids or a list of lists of token ids "
            f"(non-empty), got {type(prompt).__name__} {str(prompt)[:80]}",
        )
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_id(p) for p in prompt):
        return [_check_ids(prompt, "prompt")]
    if all(isinstance(p, list) for p in prompt):
        out: list[str | list[int]] = []
        for i, ids in enumerate(prompt):
            if not ids:
                raise CompletionsRequestError(f"prompt[{i}]", "a token-id prompt must not be empty")
            out.append(_check_ids(ids, f"prompt[{i}]"))
        return out
    bad = next(i for i, p in enumerate(prompt) if not isinstance(p, type(prompt[0])) or isinstance(p, bool))
    raise CompletionsRequestError(
        f"prompt[{bad}]",
        f"mixes kinds: prompt[0] is {type(prompt[0]).__name__}, prompt[{bad}] is {type(prompt[bad]).__name__} "
        f"{str(prompt[bad])[:80]} (a list of strings, of token ids, or of lists of token ids)",
    )


def check_vocabulary(prompts: list[str | list[int]], n_vocab: int) -> None:
    """Raise naming the field and the id when a token-id prompt holds an id outside ``[0, n_vocab)``."""
    single = len(prompts) == 1
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            continue
        for j, t in enumerate(p):
            if not 0 <= t < n_vocab:
                field = f"prompt[{j}]" if single else f"prompt[{i}][{j}]"
                raise CompletionsRequestError(
                    field, f"token id {t} is out of the vocabulary (ids 0..{n_vocab - 1})"
                )


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise CompletionsRequestError(
        "stop", f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings, got {str(stop)[:80]}"
    )


def parse_int_option(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_id(value) or not low <= value <= high:
        raise CompletionsRequestError(name, f"must be an integer from {low} to {high}, got {value!r}")
    return value


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """The character offset where each token's text starts, for tokens whose raw bytes are ``pieces``
    (a token may hold part of a UTF-8 character: offsets follow incremental decoding)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], start
    for piece in pieces:
        offsets.append(at)
        at += len(decoder.decode(piece))
    return offsets


def logprobs_block(
    tokens: list[str],
    token_logprobs: list[float | None],
    top_logprobs: list[dict[str, float] | None],
    text_offset: list[int],
) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def completion_answer(
    model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
