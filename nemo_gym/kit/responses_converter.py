"""Upstream NeMo Gym's ``ResponsesConverter``: Responses API <-> Chat Completions, as a class.

Contract
--------
* ``ResponsesConverter(return_token_id_information=..., uses_reasoning_parser=True)`` is a face over
  :mod:`nemo_gym.kit.chat_conversion` (the one conversion module; see its docstring for the mapping rules).
  Environments and model servers written against upstream's class call the same method names here.
* ``responses_to_chat_completion_create_params(params)`` -> a
  :class:`~nemo_gym.openai_utils.NeMoGymChatCompletionCreateParamsNonStreaming` whose ``messages`` are
  plain dicts (an assistant turn is one message with ``tool_calls``; ``function_call_output`` items
  become ``role: "tool"`` messages with ``tool_call_id``). With ``return_token_id_information`` the
  turn's ``prompt_token_ids`` / ``generation_token_ids`` ride on its assistant message.
* ``postprocess_assistant_message_dict(message)`` / ``postprocess_chat_response(choice)`` -> Responses
  output items (reasoning, message, function calls); ``<think>`` blocks in the content become reasoning
  unless ``uses_reasoning_parser`` is false. ``chat_completions_messages_to_responses_items(messages)``
  maps a whole chat history back to Responses items. ``chat_completion_to_response(params, completion)``
  -> a complete :class:`~nemo_gym.openai_utils.NeMoGymResponse`.
* Something Chat Completions cannot carry raises :class:`~nemo_gym.kit.chat_conversion.ChatConversionError`
  (a ``ValueError``) naming it; an unknown chat role is a ``ValueError`` naming the role.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, TypeAdapter

from nemo_gym.kit.chat_conversion import (
    THINK_CLOSE,
    THINK_OPEN,
    build_response,
    chat_message_to_output_items,
    responses_params_to_chat_request,
)
from nemo_gym.openai_utils import NeMoGymChatCompletionCreateParamsNonStreaming
from nemo_gym.openai_utils.responses import (
    NeMoGymEasyInputMessage,
    NeMoGymFunctionCallOutput,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseOutputItem,
)

_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[NeMoGymResponseOutputItem])


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return dict(value)


class ResponsesConverter(BaseModel):
    """Converts between Responses API and Chat Completions shapes (upstream's name and methods)."""

    return_token_id_information: bool = False
    uses_reasoning_parser: bool = True

    THINK_TAG_PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        re.escape(THINK_OPEN) + r"(.*?)" + re.escape(THINK_CLOSE), re.DOTALL
    )

    @staticmethod
    def _wrap_reasoning_in_think_tags(texts: list[str]) -> str:
        return "".join(f"{THINK_OPEN}{text}{THINK_CLOSE}" for text in texts if text)

    @classmethod
    def _parse_think_tags(cls, content: str) -> tuple[list[str], str]:
        return cls.THINK_TAG_PATTERN.findall(content), cls.THINK_TAG_PATTERN.sub("", content)

    def _extract_reasoning_from_content(self, content: str) -> tuple[list[str], str]:
        return self._parse_think_tags(content)

    # Responses -> Chat Completions ------------------------------------------------------------------

    def responses_to_chat_completion_create_params(
        self, responses_create_params: NeMoGymResponseCreateParamsNonStreaming | dict[str, Any]
    ) -> NeMoGymChatCompletionCreateParamsNonStreaming:
        params = _as_dict(responses_create_params)
        request = responses_params_to_chat_request(
            params, params.get("model"), keep_token_ids=self.return_token_id_information
        )
        if request.get("model") is None:
            request.pop("model")
        if "max_tokens" in request:  # the current Chat Completions name, as upstream sends it
            request["max_completion_tokens"] = request.pop("max_tokens")
        if params.get("metadata") is not None:
            request["metadata"] = params["metadata"]
        return NeMoGymChatCompletionCreateParamsNonStreaming.model_validate(request)

    # Chat Completions -> Responses ------------------------------------------------------------------

    def postprocess_assistant_message_dict(self, message_dict: dict[str, Any]) -> list[Any]:
        message = dict(message_dict)
        if message.get("content") is None:
            message["content"] = ""
        items = chat_message_to_output_items(message, parse_think_tags=self.uses_reasoning_parser)
        return _ITEMS.validate_python(items)

    def postprocess_chat_response(self, choice: Any) -> list[Any]:
        message = choice.get("message") if isinstance(choice, dict) else choice.message
        if isinstance(message, BaseModel):
            message = message.model_dump(exclude_none=True)
        return self.postprocess_assistant_message_dict(message)

    def chat_completions_messages_to_responses_items(self, messages: list[dict[str, Any]]) -> list[Any]:
        items: list[Any] = []
        for message in messages:
            message = _as_dict(message)
            role = message.get("role")
            if role in ("user", "system", "developer"):
                items.append(
                    NeMoGymEasyInputMessage.model_validate(
                        {**message, "content": message.get("content") or ""}
                    )
                )
            elif role == "assistant":
                items.extend(self.postprocess_assistant_message_dict(message))
            elif role == "tool":
                content = message.get("content")
                if isinstance(content, list):
                    content = [{"type": "input_text", "text": part.get("text", "")} for part in content]
                items.append(
                    NeMoGymFunctionCallOutput(
                        call_id=message["tool_call_id"], output=content, status="completed"
                    )
                )
            else:
                raise ValueError(
                    f"chat message role {role!r}: expected user, system, developer, assistant or tool"
                )
        return items

    def chat_completion_to_response(
        self,
        responses_create_params: NeMoGymResponseCreateParamsNonStreaming | dict[str, Any],
        chat_completion: Any,
    ) -> NeMoGymResponse:
        completion = _as_dict(chat_completion)
        choice = completion["choices"][0]
        output = [
            item.model_dump(mode="json", exclude_unset=True)
            for item in self.postprocess_chat_response(choice)
        ]
        params = _as_dict(responses_create_params)
        truncated = choice.get("finish_reason") == "length"
        response = build_response(
            params,
            output,
            completion.get("usage"),
            completion.get("model") or params.get("model") or "",
            status="incomplete" if truncated else "completed",
            incomplete_details={"reason": "max_output_tokens"} if truncated else None,
        )
        return NeMoGymResponse.model_validate(response)
