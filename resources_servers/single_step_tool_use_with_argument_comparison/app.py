"""single_step_tool_use_with_argument_comparison: the model's next step of an expert trajectory.

Contract
--------
* A row holds a conversation so far (``responses_create_params`` with its tools) and
  ``expected_action``: the expert's next step, a ``message``, a ``function_call`` (``name``,
  ``arguments`` as JSON text) or a ``function_call_batch`` (upstream NeMo Gym's field and types).
* The agent runs one model turn (``max_steps: 1``); tools are not executed (``POST /<tool>`` answers
  a fixed note). The response is read as an action (:func:`common.response_utils.extract_action`)
  and compared with ``expected_action`` by :class:`common.verification_utils.ActionComparator`
  (``tool_call_comparator_config``): reward 1.0 / 0.0 (or partial, in the parallel reward modes)
  with the ``category`` saying why. A response with no call and no text scores 0.0
  (``NO_ACTION_FOUND``).
* An ``expected_action`` that is not one of the three shapes is refused by ``ng_collect_rollouts``
  when it is not an object, and by ``/verify`` (422) when its shape or expert arguments are bad
  (upstream raises a 500 on expert arguments that are not JSON).
"""

from __future__ import annotations

from typing import ClassVar

from fastapi import FastAPI

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from resources_servers.single_step_tool_use_with_argument_comparison.common.response_utils import (
    extract_action,
)
from resources_servers.single_step_tool_use_with_argument_comparison.common.verification_utils import (
    ActionComparator,
    ExpectedAction,
    StepRewardCategory,
    ToolCallComparatorConfig,
)


class SingleStepToolUseArgumentComparisonResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    tool_call_comparator_config: ToolCallComparatorConfig


class SingleStepToolUseArgumentComparisonRunRequest(BaseRunRequest):
    expected_action: ExpectedAction


class SingleStepToolUseArgumentComparisonVerifyRequest(
    SingleStepToolUseArgumentComparisonRunRequest, BaseVerifyRequest
):
    pass


class SingleStepToolUseArgumentComparisonVerifyResponse(BaseVerifyResponse):
    expected_action: ExpectedAction
    category: StepRewardCategory


class SingleStepToolUseArgumentComparisonResourcesServer(SimpleResourcesServer):
    config: SingleStepToolUseArgumentComparisonResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/{tool_name}")(self.any_tool)  # registered last: the real endpoints win
        return app

    async def any_tool(self, tool_name: str) -> dict[str, str]:
        """Every tool of a row: not executed; the next step is what is graded."""
        return {"tool": tool_name, "status": "recorded; this environment grades the call, it does not run it"}

    async def verify(
        self, body: SingleStepToolUseArgumentComparisonVerifyRequest
    ) -> SingleStepToolUseArgumentComparisonVerifyResponse:
        actual = extract_action(body.response)
        if actual is None:
            reward, category = 0.0, StepRewardCategory.NO_ACTION_FOUND
        else:
            result = ActionComparator(config=self.config.tool_call_comparator_config).compare_action(
                body.expected_action, actual
            )
            reward, category = result.reward, result.category
        return SingleStepToolUseArgumentComparisonVerifyResponse.from_request(
            body, reward=reward, category=category
        )


if __name__ == "__main__":
    SingleStepToolUseArgumentComparisonResourcesServer.run_webserver()
