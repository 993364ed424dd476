"""Serve a local Aviary dataset with Aviary's own ``TaskDatasetServer`` (for ``remote_app.py``).

``python -m resources_servers.aviary.serve_task_dataset gsm8k [--jsonl FILE] [--host H] [--port P]``
serves GSM8K (``gsm8k``) or HotPotQA (``hotpotqa``) from the local files the in-process servers use
(or ``--jsonl``). The API key is read from the environment variable ``AVIARY_DATASET_SERVER_API_KEY``
(never from the command line, where ``ps`` shows it); unset means no key. Any other Aviary dataset is
served the same way: ``TaskDatasetServer(dataset, host=..., port=..., api_key=...).start()``.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import argparse  # noqa: E402

import uvicorn  # noqa: E402

from aviary.core import TaskDataset  # noqa: E402
from aviary.dataset_server import TaskDatasetServer  # noqa: E402
from resources_servers.aviary.app import resolve_data_path  # noqa: E402
from resources_servers.aviary.offline import GSM8kFileDataset, HotPotQAFileDataset  # noqa: E402

API_KEY_ENV = "AVIARY_DATASET_SERVER_API_KEY"


def build_dataset(name: str, jsonl: str | None) -> TaskDataset:
    if name == "gsm8k":
        return GSM8kFileDataset(resolve_data_path(jsonl, GSM8kFileDataset.DEFAULT_FILE))
    return HotPotQAFileDataset(resolve_data_path(jsonl, HotPotQAFileDataset.DEFAULT_FILE))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=["gsm8k", "hotpotqa"])
    parser.add_argument("--jsonl", default=None, help="the task file (default: the app's file in data/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8041)
    args = parser.parse_args(argv)
    server = TaskDatasetServer(
        build_dataset(args.dataset, args.jsonl),
        host=args.host,
        port=args.port,
        api_key=os.environ.get(API_KEY_ENV) or None,
    )
    # TaskDatasetServer.start() logs at debug level; the same app at info.
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
