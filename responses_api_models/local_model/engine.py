"""In-process generation with llama-cpp-python: exact prompt ids, generation ids and log-probs.

Contract
--------
* :class:`LocalLLM` loads a GGUF once. :meth:`LocalLLM.complete` renders chat messages (and tools)
  with the chat template stored in the GGUF (``tokenizer.chat_template``, rendered here with jinja2
  the way Hugging Face ``apply_chat_template`` does), tokenizes that text, and generates. The ids it
  returns are exactly the ones the model read and produced: ``prompt_token_ids`` is the evaluated
  prompt, ``generation_token_ids`` every sampled token (including the end-of-generation token when
  the model emitted one), ``generation_log_probs[i]`` the log-probability of token *i* under the
  model's raw next-token distribution (log-softmax of the logits, before temperature, top-p or a
  grammar's mask).
  ``text`` is the detokenisation of the generated ids (control tokens such as ``<|im_end|>`` render
  as nothing).
* A request may carry a GBNF ``grammar`` (see ``forced_calls.py``): only text it admits is sampled.
* Generation never runs past the context window: the budget is ``min(max_tokens, n_ctx - prompt)``.
  A prompt that does not fit leaves ``prompt_too_long`` set and generates nothing.
* A ``LocalLLM`` is not thread-safe. :class:`FairQueue` serialises calls onto one worker thread in
  arrival order (FIFO), off the event loop; at most ``max_queue`` requests wait behind the running
  one, and one more is refused at once with :class:`QueueFullError` (no unbounded backlog).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np

# numpy and llama_cpp come with the `local` extra and are imported where generation needs them, so
# this module (FairQueue, the chat template code) imports without that extra.

logger = logging.getLogger("nemo_gym.local_model")

T = TypeVar("T")

# Used only when a GGUF carries no chat template: plain ChatML without tool support.
FALLBACK_CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------------------
# Chat template rendering (as transformers' apply_chat_template does it).


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Jinja's own ``tojson`` HTML-escapes <, >, & and '; templates are written against this one.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def compile_chat_template(source: str) -> Any:
    """A jinja2 template object for a Hugging Face style chat template (sandboxed)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class UnsupportedInputError(ValueError):
    """The conversation holds something this text-only model cannot read (an image, a file...)."""


_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
                out.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") == "refusal":
                out.append(str(part.get("refusal", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UnsupportedInputError(
                    f"{where}: content part {kind!r} is not supported; this model reads text only"
                )
        return "".join(out)
    raise UnsupportedInputError(
        f"{where}: content must be a string or a list of text parts, got {type(content).__name__}"
    )


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages in the shape Hugging Face chat templates expect.

    ``developer`` becomes ``system``; content parts become one string; tool-call ``arguments`` that
    are JSON objects become dicts (templates ``tojson`` them; a string would be double-encoded).
    """
    out: list[dict[str, Any]] = []
    for index, m in enumerate(messages):
        msg = dict(m)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if msg.get("role") == "assistant" and msg.get("tool_calls") and not msg.get("content"):
            msg["content"] = None
        else:
            msg["content"] = _text_of(msg.get("content"), f"messages[{index}]")
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                call["function"] = fn
                calls.append(call)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


# ------------------------------------------------------------------------------------------------
# Generation.


@dataclass
class GenerationRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    top_logprobs: int = 0
    should_stop: Callable[[], bool] | None = None  # checked between tokens (e.g. client went away)
    grammar: str | None = None  # GBNF source constraining the output (forced tool calls)
    # Text completions (/v1/completions): these exact ids are the prompt (no chat template), and the
    # generation ends where its text first contains one of ``stop`` (the text is cut before it).
    prompt_token_ids: list[int] | None = None
    stop: list[str] | None = None
    # Streaming: called on the worker thread with each content token's id and bytes as it is generated,
    # and with the result when the generation ends (also when it was stopped by ``should_stop``).
    on_token: Callable[[int, bytes], None] | None = None
    on_finish: Callable[[GenerationResult], None] | None = None
    # The rollout the call belongs to, when its ids are kept for the rollout's later calls (app.py;
    # nemo_gym.server.rollout_tokens).
    rollout_id: str | None = None


@dataclass
class GenerationResult:
    prompt_text: str
    prompt_token_ids: list[int]
    generation_token_ids: list[int] = field(default_factory=list)
    generation_log_probs: list[float] = field(default_factory=list)
    # Per generated token: [(token id, logprob), ...] of the most likely tokens (when asked for).
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: Literal["stop", "length", "cancelled"] = "stop"
    prompt_too_long: bool = False
    prompt_eval_s: float = 0.0
    generation_s: float = 0.0
    stop_sequence: str | None = None  # the ``stop`` string that ended the generation, if one did


def default_n_threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


class LocalLLM:
    """One loaded GGUF model. Every method must be called from one thread at a time."""

    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        chat_template: str | None = None,
    ):
        from llama_cpp import Llama

        # Half the logical CPUs (about the physical cores) by default: llama.cpp's worker threads
        # spin-wait, so oversubscribing a busy machine costs far more than it gains.
        threads = n_threads or default_n_threads()
        t0 = time.monotonic()
        self.llm = Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.load_s = time.monotonic() - t0
        self.model_path = Path(model_path)
        self.n_ctx = self.llm.n_ctx()
        self.n_vocab = self.llm.n_vocab()
        meta = self.llm.metadata or {}
        source = chat_template or meta.get("tokenizer.chat_template")
        if not source:
            logger.warning(
                "%s has no chat template; using plain ChatML (no tool support in the prompt)", model_path
            )
            source = FALLBACK_CHATML_TEMPLATE
        self.chat_template_source = source
        self._template = compile_chat_template(source)
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "false") == "true"
        self._bos = self.llm.token_bos()
        self._eos = self.llm.token_eos()
        self._bos_text = self._piece(self._bos, special=True) if self._bos >= 0 else ""
        self._eos_text = self._piece(self._eos, special=True) if self._eos >= 0 else ""

    # -- tokens ------------------------------------------------------------------------------------
    def _piece(self, token: int, special: bool) -> str:
        return self.llm.detokenize([token], special=special).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token)) or token == self._eos

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens (``<|im_start|>``...) parsed as such."""
        ids = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if self.add_bos and self._bos >= 0 and (not ids or ids[0] != self._bos):
            ids = [self._bos, *ids]
        return ids

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        return self.llm.detokenize(list(ids), special=special).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (special tokens spelled out; may be part of a UTF-8 character)."""
        return self.llm.detokenize([token], special=True)

    # -- prompts -----------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text: the GGUF's chat template over the messages, ending with the assistant header."""
        return self._template.render(
            messages=messages_for_template(messages),
            tools=tools or None,
            add_generation_prompt=True,
            bos_token=self._bos_text,
            eos_token=self._eos_text,
        )

    def prompt_for(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[str, list[int]]:
        """The prompt text and the exact token ids to evaluate.

        When an earlier assistant turn carries the ids it was generated from (``prompt_token_ids`` and
        ``generation_token_ids``, as ``keep_token_ids`` conversion puts them), the prompt is those ids
        followed by the tokens of only the template text after that turn. Turn N+1's prompt then
        extends turn N's prompt and generation exactly, which is what RL training on multi-turn
        rollouts needs. If the template's rendering of the earlier conversation is not a prefix of
        the new prompt, the whole prompt is tokenised afresh instead.
        """
        prompt = self.render(messages, tools)
        last = next(
            (
                i
                for i in range(len(messages) - 1, -1, -1)
                if messages[i].get("role") == "assistant"
                and messages[i].get("prompt_token_ids")
                and messages[i].get("generation_token_ids")
            ),
            None,
        )
        if last is None:
            return prompt, self.tokenize(prompt)
        earlier = self._template.render(
            messages=messages_for_template(messages[: last + 1]),
            tools=tools or None,
            add_generation_prompt=False,
            bos_token=self._bos_text,
            eos_token=self._eos_text,
        )
        generated = [int(t) for t in messages[last]["generation_token_ids"]]
        ended = self.is_end_of_generation(generated[-1])
        marker = (
            self.token_bytes(generated[-1]).decode("utf-8", errors="replace") if ended else self._eos_text
        )
        cut = earlier.rfind(marker) if marker else -1
        if not prompt.startswith(earlier) or cut < 0:
            return prompt, self.tokenize(prompt)
        ids = [int(t) for t in messages[last]["prompt_token_ids"]] + generated
        if not ended:  # cut off by the token budget: the template closes the turn with its end marker
            ids += self.tokenize(marker)
        return prompt, ids + self.tokenize(earlier[cut + len(marker) :] + prompt[len(earlier) :])

    # -- generation --------------------------------------------------------------------------------
    def _logits(self) -> np.ndarray:
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def complete(self, req: GenerationRequest) -> GenerationResult:
        import numpy as np

        if req.prompt_token_ids is not None:
            prompt_ids = [int(t) for t in req.prompt_token_ids]
            prompt = self.detokenize(prompt_ids, special=True)
        else:
            prompt, prompt_ids = self.prompt_for(req.messages, req.tools)
        result = GenerationResult(prompt_text=prompt, prompt_token_ids=prompt_ids)
        budget = min(req.max_tokens, self.n_ctx - len(prompt_ids))
        if budget <= 0:
            result.prompt_too_long = True
            result.finish_reason = "length"
            return result
        self.llm.set_seed(req.seed & 0xFFFFFFFF)
        grammar = None
        if req.grammar is not None:
            from llama_cpp import LlamaGrammar

            grammar = LlamaGrammar.from_string(req.grammar, verbose=False)
        t0 = time.monotonic()
        t_first: float | None = None
        content_ids: list[int] = []
        finish: Literal["stop", "length", "cancelled"] = "length"
        stops = [s for s in req.stop or [] if s]
        # Only the tail can complete a stop string: its longest length in bytes, plus a token's worth.
        stop_window = max((len(s.encode()) for s in stops), default=0) + 64
        tail = b""
        gen = self.llm.generate(
            prompt_ids,
            top_k=0,
            top_p=req.top_p,
            min_p=0.0,
            typical_p=1.0,
            temp=req.temperature,
            repeat_penalty=1.0,
            reset=True,
            grammar=grammar,
        )
        try:
            for token in gen:
                if t_first is None:
                    t_first = time.monotonic()
                # The logits that produced ``token`` are still the context's last row: ``token`` itself
                # is evaluated only when the generator resumes.
                logits = self._logits().astype(np.float64)
                top = float(logits.max())
                log_z = top + math.log(float(np.exp(logits - top).sum()))
                result.generation_token_ids.append(int(token))
                result.generation_log_probs.append(float(logits[token] - log_z))
                if req.top_logprobs > 0:
                    k = min(req.top_logprobs, self.n_vocab)
                    best = np.argpartition(-logits, k - 1)[:k]
                    best = best[np.argsort(-logits[best])]
                    result.top_logprobs.append([(int(t), float(logits[t] - log_z)) for t in best])
                if self.is_end_of_generation(int(token)):
                    finish = "stop"
                    break
                content_ids.append(int(token))
                if stops:
                    tail = (tail + self.token_bytes(int(token)))[-stop_window:]
                    text = tail.decode("utf-8", errors="ignore")
                    hit = next((s for s in stops if s in text), None)
                    if hit is not None:
                        result.stop_sequence = hit
                        finish = "stop"
                        break
                if req.on_token is not None:
                    req.on_token(int(token), self.llm.detokenize([int(token)], special=False))
                if len(result.generation_token_ids) >= budget:
                    break
                if req.should_stop is not None and req.should_stop():
                    finish = "cancelled"
                    break
        finally:
            gen.close()
        t1 = time.monotonic()
        result.prompt_eval_s = (t_first or t1) - t0
        result.generation_s = t1 - (t_first or t1)
        result.text = self.detokenize(content_ids)
        cut = result.text.find(result.stop_sequence) if result.stop_sequence is not None else -1
        if cut >= 0:  # the text ends before the stop string (OpenAI's rule)
            result.text = result.text[:cut]
        result.finish_reason = finish
        if req.on_finish is not None:
            req.on_finish(result)
        return result


# ------------------------------------------------------------------------------------------------
# The queue in front of the model.


class QueueFullError(Exception):
    """More requests than ``max_queue`` are already waiting."""

    def __init__(self, running: int, waiting: int, max_queue: int):
        self.running, self.waiting, self.max_queue = running, waiting, max_queue
        super().__init__(f"{running} request(s) generating and {waiting} waiting (max_queue={max_queue})")


class FairQueue:
    """Runs blocking calls one at a time on a dedicated thread, first come first served.

    At most ``max_queue`` calls wait while one runs; a further call raises :class:`QueueFullError`
    at once. A caller cancelled while waiting leaves the queue without running.
    """

    def __init__(self, max_queue: int, thread_name: str = "local-llm"):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._lock = asyncio.Lock()  # FIFO: waiters are woken in arrival order
        self.waiting = 0
        self.running = 0
        self.completed = 0

    async def run(self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None) -> T:
        """``fn(*args)`` on the worker thread, after every call that arrived earlier.

        If the caller is cancelled while ``fn`` runs, ``on_cancel`` is called (it should make ``fn``
        return soon); the worker thread runs one call at a time, so the next call still starts only
        after this one has really finished.
        """
        if self.waiting >= self.max_queue and self.running + self.waiting > 0:
            raise QueueFullError(self.running, self.waiting, self.max_queue)
        self.waiting += 1
        queued = True
        try:
            async with self._lock:
                self.waiting -= 1
                queued = False
                self.running += 1
                try:
                    future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
                    try:
                        return await future
                    except asyncio.CancelledError:
                        if on_cancel is not None:
                            on_cancel()
                        raise
                finally:
                    self.running -= 1
                    self.completed += 1
        finally:
            if queued:
                self.waiting -= 1

    def stats(self) -> dict[str, int]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "max_queue": self.max_queue,
            "completed": self.completed,
        }

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
