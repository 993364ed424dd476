"""The model's next action, read from its response in the shape the rows use (``extract_action``)."""

from __future__ import annotations

from nemo_gym.openai_utils import NeMoGymResponse
from resources_servers.single_step_tool_use_with_argument_comparison.common.verification_utils import (
    Action,
    FunctionCallAction,
    FunctionCallBatchAction,
    MessageAction,
)


def extract_action(response: NeMoGymResponse) -> Action | None:
    """Tool calls win over text: one call is a ``function_call``, several a ``function_call_batch``;
    without calls, the first text of the assistant messages that is not blank is a ``message`` (an
    empty or whitespace-only message says nothing); nothing: None."""
    calls: list[FunctionCallAction] = []
    text: str | None = None
    for item in response.output:
        if item.type == "function_call":
            calls.append(FunctionCallAction(type="function_call", name=item.name, arguments=item.arguments))
        elif item.type == "message" and getattr(item, "role", "assistant") == "assistant" and text is None:
            text = next(
                (p.text for p in item.content if p.type == "output_text" and p.text and p.text.strip()), None
            )
    if len(calls) == 1:
        return calls[0]
    if calls:
        return FunctionCallBatchAction(type="function_call_batch", calls=calls)
    return MessageAction(type="message", content=text) if text is not None else None
