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
  Reward: ``binary`` 1.0 iff all are followed, ``fraction`` the fraction followed.
* An unknown instruction id, or kwargs an instruction cannot use, is bad data, never a failed
  instruction (upstream scores it False): ``ng_collect_rollouts`` refuses a row whose top-level
  ``instruction_id_list`` has an unknown id (file, line, field) before any rollout, and ``/verify``
  answers 422 naming the instruction for the rest (ids under ``verifier_metadata``, bad kwargs,
  lists of different lengths).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal

from fastapi import HTTPException
from pydantic import Field, model_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from resources_servers.instruction_following.instructions import (
    INSTRUCTION_IDS,
    BadInstruction,
    check,
    warm_up,
)

InstructionId = Literal[INSTRUCTION_IDS]  # type: ignore[valid-type]
_VERIFIER_FIELDS = ("instruction_id_list", "prompt", "kwargs", "grading_mode")


class InstructionFollowingResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS


class InstructionFollowingRunRequest(BaseRunRequest):
    id: int | str | None = None
    instruction_id_list: list[InstructionId] | None = Field(
        default=None, description="The instructions to check (or under verifier_metadata)."
    )
    kwargs: list[dict[str, Any] | None] | None = None
    prompt: str | None = None
    grading_mode: Literal["binary", "fraction"] | None = None
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


def _last_assistant_text(body: BaseVerifyRequest) -> str:
    for item in reversed(body.response.output):
        if item.type == "message" and getattr(item, "role", "assistant") == "assistant":
            return "".join(getattr(part, "text", "") or "" for part in item.content)
    return ""


def _check_all(ids: list[str], kwargs_list: list[Any], text: str) -> list[bool]:
    return [check(i, k, text) for i, k in zip(ids, kwargs_list, strict=True)]


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
        text = _last_assistant_text(body)
        try:  # off the event loop: Punkt and langdetect are CPU work
            followed = await asyncio.to_thread(_check_all, ids, kwargs_list, text)
        except BadInstruction as e:
            raise HTTPException(422, f"bad row: {e}") from None
        reward = float(all(followed)) if mode == "binary" else sum(followed) / len(followed)
        fields = body.model_dump(exclude={"reward", "follow_all_instructions", "follow_instruction_list"})
        return InstructionFollowingVerifyResponse(
            **fields, reward=reward, follow_all_instructions=all(followed), follow_instruction_list=followed
        )

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
        return out


if __name__ == "__main__":
    InstructionFollowingResourcesServer.run_webserver()
