"""HotPotQA (Aviary's ``HotPotQAEnv``) with ``search`` over a local distractor-format corpus (no Wikipedia)."""

from typing import ClassVar

from pydantic import Field

from resources_servers.aviary.app import AviaryResourcesServer
from resources_servers.aviary.offline import HotPotQAFileDataset, OfflineHotPotQAEnv


class HotPotQAResourcesServer(AviaryResourcesServer[OfflineHotPotQAEnv, HotPotQAFileDataset]):
    dataset: HotPotQAFileDataset = Field(
        default_factory=lambda data: HotPotQAFileDataset.from_config(data["config"])
    )

    # Construction and reset() are CPU work only (Tool.from_function for every tool): off the loop.
    RESET_OFF_LOOP: ClassVar[bool] = True


if __name__ == "__main__":
    HotPotQAResourcesServer.run_webserver()
