"""instruction_following: IFEval-style verifiable instructions ("no commas", "exactly 3 bullets", ...).

Contract
--------
* A row carries ``instruction_id_list``, ``kwargs`` (one mapping per instruction, ``None`` values
  ignored) and ``prompt``, at the top level or under ``verifier_metadata`` (upstream NeMo Gym's two
  layouts; ``verifier_metadata`` wins), plus optional ``grading_mode`` (``binary``, default, or
  ``fraction``) and ``id``.
* The text checked is that of the last assistant message of the response. Each instruction is
  checked by :mod:`instructions` (IFEval's 25 instructions and five of IFBench's, written here).
  ``follow_instruction_list`` holds one bool per instruction; ``follow_all_instructions`` their AND.
  Reward: ``binary`` 1.0 iff all are followed, ``fraction`` the fraction followed; ``failure_reason``
  names what was not followed (None when all were).
* Content (ours): a row may carry ``content_keywords`` (entries: a word, or a list of alternative
  words, each to be mentioned as a word or a word's start, case and compatibility forms ignored) and
  ``content_min_words`` (the fewest words, runs of word characters; default
  :data:`DEFAULT_CONTENT_MIN_WORDS` with keywords), at the top level or under ``verifier_metadata``. A reply that misses them scores 0.0 in
  either mode, ``addresses_request`` False and the reason in ``failure_reason``; IFEval's verdicts stay
  as they are. A row without them is scored on form only (upstream's rule); bad values are a 422.
* A reply holding the row's ``prompt`` or a user message whole (:data:`ECHO_MIN_CHARS` or more,
  whitespace and case ignored) follows nothing: an echo of the task is not an answer, though a prompt's
  own words can satisfy its instructions (rows with ``combination:repeat_prompt`` excepted).
* Checks run on a thread; an answer longer than ``pool_threshold_chars`` is checked in the verify pool,
  bounded by ``check_timeout_seconds`` (plus :data:`IMPORT_ALLOWANCE_SECONDS` for a fresh worker's NLTK
  import), once more on a fresh worker if killed or crashed, and then follows nothing, with the reason
  (the answer's doing, never a 503).
* An unknown instruction id, or kwargs an instruction cannot use, is bad data, never a failed
  instruction (upstream scores it False): ``ng_collect_rollouts`` refuses a row whose top-level
  ``instruction_id_list`` has an unknown id (file, line, field) before any rollout, and ``/verify``
  answers 422 naming the instruction for the rest (ids under ``verifier_metadata``, bad kwargs,
  lists of different lengths).
"""

from __future__ import annotations

import asyncio
import json
import re
import unicodedata
from functools import lru_cache
from typing import Any, ClassVar, Literal

from fastapi import HTTPException
from pydantic import Field, PositiveFloat, model_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    run_in_verify_pool,
)
from nemo_gym.openai_utils import text_of_message
from resources_servers.instruction_following.instructions import (
    INSTRUCTION_IDS,
    BadInstruction,
    check,
    warm_up,
)

InstructionId = Literal[INSTRUCTION_IDS]  # type: ignore[valid-type]
_VERIFIER_FIELDS = (
    "instruction_id_list",
    "prompt",
    "kwargs",
    "grading_mode",
    "content_keywords",
    "content_min_words",
)
# A row with content_keywords and no content_min_words needs a reply of at least this many words.
DEFAULT_CONTENT_MIN_WORDS = 5
# Added to check_timeout_seconds for the pool's bound: a fresh worker imports NLTK first.
IMPORT_ALLOWANCE_SECONDS = 60.0


class InstructionFollowingResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    # Answers longer than this are checked in the verify pool (a worker process), bounded by
    # check_timeout_seconds (plus a fresh worker's NLTK import); shorter ones on a thread.
    pool_threshold_chars: int = Field(default=20_000, ge=0)
    check_timeout_seconds: PositiveFloat = 60.0


class InstructionFollowingRunRequest(BaseRunRequest):
    id: int | str | None = None
    instruction_id_list: list[InstructionId] | None = Field(
        default=None, description="The instructions to check (or under verifier_metadata)."
    )
    kwargs: list[dict[str, Any] | None] | None = None
    prompt: str | None = None
    grading_mode: Literal["binary", "fraction"] | None = None
    # Ours (optional): what the reply must hold to address the request, besides the instructions.
    content_keywords: list[str | list[str]] | None = Field(
        default=None,
        description="Words the reply must mention (each entry a word or a list of alternatives).",
    )
    content_min_words: int | None = Field(
        default=None, ge=1, description="The fewest words a reply to the request can have."
    )
    verifier_metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _merge_layouts(self) -> InstructionFollowingRunRequest:
        """Top-level fields fill in what ``verifier_metadata`` lacks (upstream's legacy layout)."""
        merged = dict(self.verifier_metadata)
        for name in _VERIFIER_FIELDS:
            if name not in merged and getattr(self, name) is not None:
                merged[name] = getattr(self, name)
        self.verifier_metadata = merged
        return self


class InstructionFollowingVerifyRequest(InstructionFollowingRunRequest, BaseVerifyRequest):
    pass


class InstructionFollowingVerifyResponse(BaseVerifyResponse):
    follow_all_instructions: bool
    follow_instruction_list: list[bool]
    verifier_metadata: dict[str, Any]
    # Whether the reply addresses the request (content_keywords, content_min_words); None for a row
    # without them (scored on its instructions only).
    addresses_request: bool | None = None
    # Why the reward is below 1 (None when every instruction is followed).
    failure_reason: str | None = None


def _last_assistant_text(body: BaseVerifyRequest) -> str:
    for item in reversed(body.response.output):
        if item.type == "message" and getattr(item, "role", "assistant") == "assistant":
            return "".join(getattr(part, "text", "") or "" for part in item.content)
    return ""


def _check_all(ids: list[str], kwargs_list: list[Any], text: str) -> list[bool]:
    return [check(i, k, text) for i, k in zip(ids, kwargs_list, strict=True)]


def check_all_in_worker(ids: list[str], kwargs_list: list[Any], text: str) -> list[bool] | str:
    """:func:`_check_all` in a verify-pool worker: the verdicts, or a bad row's message (picklable)."""
    try:
        return _check_all(ids, kwargs_list, text)
    except BadInstruction as e:
        return str(e)


_WORD = re.compile(r"\w+")


def content_spec(meta: dict[str, Any]) -> tuple[list[list[str]], int] | None:
    """The row's content requirement: (keyword entries, each a list of alternatives; the fewest words),
    or None for a row without ``content_keywords`` / ``content_min_words``. Raises ValueError for
    values that cannot be used (bad data)."""
    keywords, min_words = meta.get("content_keywords"), meta.get("content_min_words")
    if keywords is None and min_words is None:
        return None
    if keywords is None:
        keywords = []
    if not isinstance(keywords, list):
        raise ValueError("content_keywords must be a list of words (or of lists of alternative words)")
    entries: list[list[str]] = []
    for entry in keywords:
        alternatives = [entry] if isinstance(entry, str) else entry
        if (
            not isinstance(alternatives, list)
            or not alternatives
            or not all(isinstance(a, str) and a.strip() for a in alternatives)
        ):
            raise ValueError(f"content_keywords: {json.dumps(entry)} is not a word or a list of words")
        entries.append(alternatives)
    if min_words is None:
        min_words = DEFAULT_CONTENT_MIN_WORDS
    if isinstance(min_words, bool) or not isinstance(min_words, int) or min_words < 1:
        raise ValueError(f"content_min_words must be a whole number >= 1, got {json.dumps(min_words)}")
    return entries, min_words


@lru_cache(maxsize=4096)
def _keyword_pattern(keyword: str) -> re.Pattern[str]:
    """A keyword found as a word or the start of one ("plant" in "plants"), case and compatibility
    forms ignored, any whitespace between its words."""
    words = unicodedata.normalize("NFKC", keyword).casefold().split()
    return re.compile(r"(?<!\w)" + r"\s+".join(map(re.escape, words)))


def content_problem(text: str, keywords: list[list[str]], min_words: int) -> str | None:
    """Why ``text`` does not address the request (too few words, a keyword never mentioned), or None.
    Linear in the text: words are counted up to ``min_words``, each keyword searched once."""
    words = 0
    for _ in _WORD.finditer(text):
        words += 1
        if words >= min_words:
            break
    if words < min_words:
        plural = "" if words == 1 else "s"
        return (
            f"the reply does not address the request: {words} word{plural}, fewer than {min_words}"
            " (content_min_words)"
        )
    normalised = unicodedata.normalize("NFKC", text).casefold()
    for alternatives in keywords:
        if not any(_keyword_pattern(a).search(normalised) for a in alternatives):
            shown = " or ".join(json.dumps(a, ensure_ascii=False) for a in alternatives)
            return f"the reply does not address the request: it never mentions {shown} (content_keywords)"
    return None


# An answer holding the whole prompt (normalised) of at least this many characters is an echo.
ECHO_MIN_CHARS = 40


def _squash(text: str) -> str:
    return " ".join(text.split()).lower()


def echoes_the_prompt(text: str, prompts: list[str]) -> bool:
    """Whether ``text`` holds one of ``prompts`` whole (whitespace and case ignored): the task repeated
    is not an answer to it, though its own words can satisfy its instructions (``<<title>>``, "P.S.",
    an end phrase quoted in the prompt)."""
    answer = _squash(text)
    return any(len(p) >= ECHO_MIN_CHARS and p in answer for p in map(_squash, prompts) if p)


_WARMUPS: list[asyncio.Future[None]] = []  # kept referenced until done


class InstructionFollowingResourcesServer(SimpleResourcesServer):
    config: InstructionFollowingResourcesServerConfig

    async def on_startup(self) -> None:
        await super().on_startup()
        # NLTK (IFEval's sentence and word tokenizers) takes seconds to import: load it in the
        # background so neither the first /verify nor the event loop waits for it.
        _WARMUPS[:] = [asyncio.get_running_loop().run_in_executor(None, warm_up)]

    async def verify(self, body: InstructionFollowingVerifyRequest) -> InstructionFollowingVerifyResponse:
        meta = body.verifier_metadata
        ids, kwargs_list = meta.get("instruction_id_list"), meta.get("kwargs")
        mode = meta.get("grading_mode") or "binary"
        if not isinstance(ids, list) or not ids or not isinstance(kwargs_list, list):
            raise HTTPException(422, "bad row: instruction_id_list and kwargs (lists) are required")
        if len(ids) != len(kwargs_list):
            raise HTTPException(
                422, f"bad row: {len(ids)} instruction ids but {len(kwargs_list)} kwargs entries"
            )
        if mode not in ("binary", "fraction"):
            raise HTTPException(422, f"bad row: grading_mode must be binary or fraction, got {mode!r}")
        try:
            content = content_spec(meta)
        except ValueError as e:
            raise HTTPException(422, f"bad row: {e}") from None
        text = _last_assistant_text(body)
        reason = None
        addresses: bool | None = None
        problem: str | None = None
        if "combination:repeat_prompt" not in ids and echoes_the_prompt(text, self._prompts(body)):
            followed = [False] * len(ids)
            reason = "the answer repeats the prompt: an echo of the task is not an answer to it"
            addresses = False if content is not None else None
        elif len(text) > self.config.pool_threshold_chars:
            followed, reason = await self._check_in_pool(ids, kwargs_list, text)
        else:
            try:  # off the event loop: Punkt and langdetect are CPU work
                followed = await asyncio.to_thread(_check_all, ids, kwargs_list, text)
            except BadInstruction as e:
                raise HTTPException(422, f"bad row: {e}") from None
        if content is not None and reason is None:  # off the loop: a reply may be megabytes
            problem = await asyncio.to_thread(content_problem, text, *content)
            addresses = problem is None
        reward = float(all(followed)) if mode == "binary" else sum(followed) / len(followed)
        if problem is not None:  # the instructions' form without the request's content earns nothing
            reward = 0.0
        if reason is None and not all(followed):
            broken = [i for i, ok in zip(ids, followed, strict=True) if not ok]
            reason = "not followed: " + ", ".join(broken) + ("" if text.strip() else " (the answer is blank)")
        reasons = [r for r in (reason, problem) if r is not None]
        fields = body.model_dump(
            exclude={
                "reward",
                "follow_all_instructions",
                "follow_instruction_list",
                "addresses_request",
                "failure_reason",
            }
        )
        return InstructionFollowingVerifyResponse(
            **fields,
            reward=reward,
            follow_all_instructions=all(followed),
            follow_instruction_list=followed,
            addresses_request=addresses,
            failure_reason="; ".join(reasons) or None,
        )

    @staticmethod
    def _prompts(body: InstructionFollowingVerifyRequest) -> list[str]:
        """The row's ``prompt`` and the text of its user messages."""
        prompts = [p for p in [body.verifier_metadata.get("prompt")] if isinstance(p, str)]
        params = body.responses_create_params
        if isinstance(params.input, str):
            return [*prompts, params.input]
        for item in params.input or []:
            role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
            if role == "user":
                prompts.append(text_of_message(item))
        return prompts

    async def _check_in_pool(
        self, ids: list[str], kwargs_list: list[Any], text: str
    ) -> tuple[list[bool], str | None]:
        """A long answer's checks in the verify pool, bounded: a check killed past its bound, or whose
        worker dies, is tried once more on a fresh worker; twice is the answer's doing (nothing
        followed, with the reason), never a 503."""
        bound = self.config.check_timeout_seconds + IMPORT_ALLOWANCE_SECONDS
        why = ""
        for _ in range(2):
            try:
                result = await run_in_verify_pool(check_all_in_worker, ids, kwargs_list, text, timeout=bound)
            except VerifyTimeoutError:
                why = f"the checks did not finish within {bound:g} s on the answer (twice)"
                continue
            except VerifyWorkerCrashedError:
                why = "the checks' worker died on the answer (twice)"
                continue
            if isinstance(result, str):
                raise HTTPException(422, f"bad row: {result}")
            return result, None
        return [False] * len(ids), why

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Rates of whole rows followed (prompt level) and of single instructions (instruction level)."""
        rollouts = [r for rs in tasks for r in rs]
        flags = [f for r in rollouts for f in r.get("follow_instruction_list") or []]
        out: dict[str, Any] = {}
        if rollouts:
            out["prompt_level_accuracy"] = sum(
                bool(r.get("follow_all_instructions")) for r in rollouts
            ) / len(rollouts)
        if flags:
            out["instruction_level_accuracy"] = sum(flags) / len(flags)
        addressed = [r["addresses_request"] for r in rollouts if r.get("addresses_request") is not None]
        if addressed:
            out["request_addressed_rate"] = sum(map(bool, addressed)) / len(addressed)
        return out


if __name__ == "__main__":
    InstructionFollowingResourcesServer.run_webserver()
