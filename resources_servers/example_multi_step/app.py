"""example_multi_step: look up a value per word with one tool, then report them all with another.

Contract
--------
* ``POST /get_synonym_value`` ``{"synonym": str}`` -> ``{"synonym": str, "synonym_value": int}``.
  The value is a pure function of the word (SHA-256 of the stripped, lower-cased word, reduced to
  0..999), so it is the same in every process, on every machine, and for "Blazing" and "blazing".
* ``POST /extract_synonym_values`` ``{"synonym_values": [int, ...]}`` -> ``{"success": true}``.
  It only acknowledges; the verifier reads the answer from the trajectory. Values must be JSON
  integers (``"12"`` or ``12.0`` fail validation, and the model is shown the error).
* Task rows carry ``expected_synonyms`` (the words to look up, in order) and
  ``expected_synonym_values`` (their values, same order).
* ``POST /verify``: reward 1.0 iff the arguments of the LAST ``extract_synonym_values`` call are
  exactly ``expected_synonym_values`` (same values, same order, same length) AND every word of
  ``expected_synonyms`` was looked up with ``get_synonym_value`` and its answer was in the trajectory
  before that call (the values must come from the lookups, not from memory: a report made before, or
  in the same turn as, the lookups scores 0); otherwise 0.0, with ``failure_reason`` saying why
  (``None`` when the reward is 1). A last call whose arguments are not valid counts as an empty
  answer. Extra numeric fields, computed on
  the sets of values of that last call (all 0.0 when there is no call or the answer is empty):
    - ``set_overlap``   = |expected ∩ answered| / |expected|   (recall over distinct values)
    - ``set_precision`` = |expected ∩ answered| / |answered|
    - ``set_jaccard``   = |expected ∩ answered| / |expected ∪ answered|
  plus ``num_synonym_lookups`` and ``num_extract_calls`` (call counts in the trajectory).
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server.resources import function_calls

SYNONYM_VALUE_MODULUS = 1000


def synonym_value(word: str) -> int:
    """The value of ``word``: deterministic across processes (never Python's salted ``hash()``)."""
    digest = hashlib.sha256(word.strip().lower().encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % SYNONYM_VALUE_MODULUS


class ExampleMultiStepConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = (
        ReverifyMode.STATELESS
    )  # verify reads only the row and the response


class GetSynonymValueRequest(BaseModel):
    synonym: str = Field(description="The word to look up, e.g. 'Blazing'.")


class GetSynonymValueResponse(BaseModel):
    synonym: str
    synonym_value: int


class ExtractSynonymValuesRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    synonym_values: list[StrictInt] = Field(
        description="The looked-up values, in the order the words were asked for."
    )


class ExtractSynonymValuesResponse(BaseModel):
    success: bool


class MultiStepVerifyRequest(BaseVerifyRequest):
    expected_synonyms: list[str] = Field(min_length=1)
    expected_synonym_values: list[int] = Field(min_length=1)


class MultiStepVerifyResponse(BaseVerifyResponse):
    failure_reason: str | None = None
    set_overlap: float
    set_precision: float
    set_jaccard: float
    num_synonym_lookups: int
    num_extract_calls: int


def parse_extracted_values(arguments: str) -> list[int]:
    """The values of one ``extract_synonym_values`` call, judged as the tool judges them; [] if invalid."""
    try:
        return ExtractSynonymValuesRequest.model_validate_json(arguments).synonym_values
    except ValidationError:
        return []


def _item_field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def words_read_before(output: list[Any], stop: int) -> set[str]:
    """The words (stripped, lower-cased, as the tool reads them) whose ``get_synonym_value`` answer is in
    ``output`` before item ``stop``: what the model had read when it wrote item ``stop``. An answer counts
    only if its value is the word's value (tool outputs are the server's, never the model's, but the
    check costs nothing)."""
    seen: set[str] = set()
    for item in output[:stop]:
        if _item_field(item, "type") != "function_call_output":
            continue
        text = _item_field(item, "output")
        try:
            value = orjson.loads(text) if isinstance(text, str) else None
        except orjson.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            continue
        word, number = value.get("synonym"), value.get("synonym_value")
        if isinstance(word, str) and type(number) is int and number == synonym_value(word):
            seen.add(word.strip().lower())
    return seen


def set_metrics(expected: list[int], answered: list[int]) -> dict[str, float]:
    """Overlap of the distinct expected and answered values (see the module docstring)."""
    exp, ans = set(expected), set(answered)
    common = len(exp & ans)
    union = len(exp | ans)
    return {
        "set_overlap": common / len(exp) if exp else 0.0,
        "set_precision": common / len(ans) if ans else 0.0,
        "set_jaccard": common / union if union else 0.0,
    }


class ExampleMultiStepServer(SimpleResourcesServer):
    config: ExampleMultiStepConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/get_synonym_value")(self.get_synonym_value)
        app.post("/extract_synonym_values")(self.extract_synonym_values)
        return app

    async def get_synonym_value(self, body: GetSynonymValueRequest) -> GetSynonymValueResponse:
        return GetSynonymValueResponse(synonym=body.synonym, synonym_value=synonym_value(body.synonym))

    async def extract_synonym_values(self, body: ExtractSynonymValuesRequest) -> ExtractSynonymValuesResponse:
        return ExtractSynonymValuesResponse(success=True)

    async def verify(self, body: MultiStepVerifyRequest) -> MultiStepVerifyResponse:
        extract_calls = function_calls(body.response, "extract_synonym_values")
        answered = parse_extracted_values(extract_calls[-1].arguments) if extract_calls else []
        metrics: dict[str, Any] = set_metrics(body.expected_synonym_values, answered)
        reason: str | None = None
        if not extract_calls:
            reason = "no extract_synonym_values call"
        elif not answered:
            reason = "the last extract_synonym_values call has no valid list of integers"
        elif answered != body.expected_synonym_values:
            reason = "the last extract_synonym_values call does not report the expected values in order"
        else:
            output = body.response.output
            last = max(i for i, item in enumerate(output) if item is extract_calls[-1])
            read = words_read_before(output, last)
            unread = [w for w in body.expected_synonyms if w.strip().lower() not in read]
            if unread:
                reason = (
                    "values reported without having read their lookup first (get_synonym_value, answered "
                    f"before the last extract_synonym_values call): {', '.join(unread)}"
                )
        return MultiStepVerifyResponse.from_request(
            body,
            reward=0.0 if reason else 1.0,
            failure_reason=reason,
            **metrics,
            num_synonym_lookups=len(function_calls(body.response, "get_synonym_value")),
            num_extract_calls=len(extract_calls),
        )


if __name__ == "__main__":
    ExampleMultiStepServer.run_webserver()
