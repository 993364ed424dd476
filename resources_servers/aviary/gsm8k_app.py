"""GSM8K with a calculator (Aviary's ``CalculatorEnv``) over a local GSM8K-format JSONL file."""

from typing import ClassVar

from pydantic import Field

from resources_servers.aviary.app import AviaryResourcesServer
from resources_servers.aviary.offline import CalculatorEnv, GSM8kFileDataset


class GSM8kResourcesServer(AviaryResourcesServer[CalculatorEnv, GSM8kFileDataset]):
    dataset: GSM8kFileDataset = Field(
        default_factory=lambda data: GSM8kFileDataset.from_config(data["config"])
    )

    # Construction and reset() are CPU work only (Tool.from_function for every tool): off the loop.
    RESET_OFF_LOOP: ClassVar[bool] = True


if __name__ == "__main__":
    GSM8kResourcesServer.run_webserver()
