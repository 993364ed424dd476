"""local_model's ``POST /v1/completions`` (the legacy OpenAI Completions API): raw prompts, no chat template.

Contract
--------
* ``prompt``: a string, a list of strings, a list of token ids or a list of lists of token ids; each
  prompt is one choice (``index`` = its position). A text prompt is tokenised as the model's
  tokenizer does (special tokens such as ``<|im_start|>`` parsed as such, the BOS token added when the
  GGUF asks for it); a token-id prompt is evaluated exactly as given. An id outside the vocabulary is
  a 400 naming the field (``prompt[3]`` / ``prompt[1][3]``) and the id.
* ``max_tokens`` (default 16, the API's), ``temperature``, ``top_p``, ``seed``, ``stop`` (a string or
  up to 4; the text ends before the first one generated, ``finish_reason: "stop"``), ``logprobs``
  (0..20: each generated token's log-probability and the ``logprobs`` most likely alternatives),
  ``echo`` (the prompt is put before the generated text; with ``logprobs`` the prompt's tokens are
  listed too, **with null log-probabilities**: this server keeps only the last position's logits, so
  it cannot score the prompt), ``user`` (ignored).
* Refused by name with a 400: ``n`` > 1 and ``best_of`` > 1 (one choice per prompt), ``stream: true``,
  ``suffix``, a non-empty ``logit_bias``, non-zero ``presence_penalty`` / ``frequency_penalty``, and
  any field the API does not have.
* Training fields on each choice when the server's ``return_token_id_information`` is on or the
  request sets ``return_token_ids: true`` (vLLM's name): ``prompt_token_ids``, ``generation_token_ids``
  (every sampled id, the end-of-generation token included) and ``generation_log_probs`` (raw model
  distribution), the names ``/v1/responses`` uses.
* A prompt that leaves no room in the context window (``n_ctx``) is a 400 naming ``prompt``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from nemo_gym.errors import error_envelope
from nemo_gym.kit.completions import (
    DEFAULT_MAX_TOKENS,
    CompletionsRequestError,
    check_vocabulary,
    completion_answer,
    logprobs_block,
    parse_int_option,
    parse_prompts,
    parse_stop,
    text_offsets,
)
from nemo_gym.server.model import ModelAnswer

if TYPE_CHECKING:
    from responses_api_models.local_model.app import LocalModel
    from responses_api_models.local_model.engine import GenerationResult, LocalLLM

KNOWN_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
        "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias",
        "user", "suffix", "seed", "return_token_ids",
    }
)  # fmt: skip
MAX_LOGPROBS = 20


def _refusals(body: dict[str, Any]) -> None:
    """Raise naming the first field this server cannot honour."""
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise CompletionsRequestError(unknown[0], f"is not a Completions API field (unknown: {unknown})")
    if body.get("stream"):
        raise CompletionsRequestError(
            "stream", "local_model answers /v1/completions without streaming; send stream: false"
        )
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise CompletionsRequestError(
                name, f"local_model generates one choice per prompt, so it must be 1; got {body.get(name)!r}"
            )
    if body.get("suffix") not in (None, ""):
        raise CompletionsRequestError("suffix", "insertion (a suffix) is not supported by local_model")
    if body.get("logit_bias"):
        raise CompletionsRequestError("logit_bias", "is not supported by local_model")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise CompletionsRequestError(name, "is not supported by local_model (leave it 0)")
    if body.get("echo") not in (None, True, False):
        raise CompletionsRequestError("echo", f"must be a boolean, got {body.get('echo')!r}")


def _bad_request(model: LocalModel, request: Request, error: CompletionsRequestError | str) -> Response:
    param = {"param": error.field} if isinstance(error, CompletionsRequestError) else {}
    body = error_envelope(
        "bad_request", server=model.config.name, path=request.url.path, message=str(error), **param
    )
    return ModelAnswer(body, 400)


def _piece(llm: LocalLLM, token: int) -> str:
    return llm.token_bytes(token).decode("utf-8", errors="replace")


def _choice(
    llm: LocalLLM,
    index: int,
    prompt_text: str,
    result: GenerationResult,
    echo: bool,
    logprobs: int | None,
    with_ids: bool,
) -> dict[str, Any]:
    text = (prompt_text if echo else "") + result.text
    block = None
    if logprobs is not None:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        pieces: list[bytes] = []
        if echo:  # the prompt's tokens, unscored (see the module docstring)
            for t in result.prompt_token_ids:
                tokens.append(_piece(llm, t))
                token_logprobs.append(None)
                top.append(None)
                pieces.append(llm.llm.detokenize([t], special=False))
        for i, (t, lp) in enumerate(
            zip(result.generation_token_ids, result.generation_log_probs, strict=True)
        ):
            tokens.append(_piece(llm, t))
            token_logprobs.append(lp)
            alternatives = {
                _piece(llm, a): a_lp
                for a, a_lp in (result.top_logprobs[i] if i < len(result.top_logprobs) else [])
            }
            alternatives.setdefault(_piece(llm, t), lp)
            top.append(alternatives)
            pieces.append(llm.llm.detokenize([t], special=False))
        offsets = text_offsets(pieces)
        if echo:  # generated tokens start where the echoed prompt text ends
            n = len(result.prompt_token_ids)
            shift = len(prompt_text) - (offsets[n] if n < len(offsets) else len(prompt_text))
            offsets = offsets[:n] + [o + shift for o in offsets[n:]]
        block = logprobs_block(tokens, token_logprobs, top, offsets)
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": block,
        "finish_reason": "stop" if result.finish_reason == "stop" else "length",
        "stop_reason": result.stop_sequence,
    }
    if with_ids:
        choice.update(
            prompt_token_ids=result.prompt_token_ids,
            generation_token_ids=result.generation_token_ids,
            generation_log_probs=result.generation_log_probs,
        )
    return choice


async def completions(model: LocalModel, request: Request, body: dict[str, Any]) -> Response:
    """The ``/v1/completions`` answer of ``model`` for ``body`` (see the module docstring)."""
    if not isinstance(body, dict):
        return _bad_request(model, request, "the body must be a JSON object")
    llm = model.llm
    try:
        _refusals(body)
        if "prompt" not in body:
            raise CompletionsRequestError("prompt", "is required")
        prompts = parse_prompts(body["prompt"])
        check_vocabulary(prompts, llm.n_vocab)
        stops = parse_stop(body.get("stop"))
        logprobs = parse_int_option(body, "logprobs", None, 0, MAX_LOGPROBS)
        max_tokens = parse_int_option(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, llm.n_ctx)
    except CompletionsRequestError as e:
        return _bad_request(model, request, e)
    echo = bool(body.get("echo"))
    with_ids = model.config.return_token_id_information or body.get("return_token_ids") is True
    choices = []
    prompt_tokens = completion_tokens = 0
    for index, prompt in enumerate(prompts):
        ids = llm.tokenize(prompt) if isinstance(prompt, str) else prompt
        gen = model._request(
            [], None, max_tokens, body.get("temperature"), body.get("top_p"), body.get("seed"), logprobs or 0
        )
        if isinstance(gen, str):
            return _bad_request(model, request, gen)
        gen.prompt_token_ids = ids
        gen.stop = stops
        result = await model._run(request, gen)
        if isinstance(result, Response):
            return result
        if result.prompt_too_long:
            field = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
            return _bad_request(
                model,
                request,
                CompletionsRequestError(
                    field,
                    f"is {len(ids)} tokens; the context window (n_ctx) is {llm.n_ctx}: no room to generate",
                ),
            )
        prompt_text = prompt if isinstance(prompt, str) else llm.detokenize(ids, special=True)
        choices.append(_choice(llm, index, prompt_text, result, echo, logprobs, with_ids))
        prompt_tokens += len(result.prompt_token_ids)
        completion_tokens += len(result.generation_token_ids)
    answer = completion_answer(
        body.get("model") or model.model_name, choices, prompt_tokens, completion_tokens
    )
    return ModelAnswer(answer)
