"""HotPotQA (Aviary's ``HotPotQAEnv``) with ``search`` over a local distractor-format corpus (no Wikipedia)."""

from pydantic import Field

from resources_servers.aviary.app import AviaryResourcesServer
from resources_servers.aviary.offline import HotPotQAFileDataset, OfflineHotPotQAEnv


class HotPotQAResourcesServer(AviaryResourcesServer[OfflineHotPotQAEnv, HotPotQAFileDataset]):
    dataset: HotPotQAFileDataset = Field(
        default_factory=lambda data: HotPotQAFileDataset.from_config(data["config"])
    )


if __name__ == "__main__":
    HotPotQAResourcesServer.run_webserver()
