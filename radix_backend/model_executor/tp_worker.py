"""Entry point of a spawned tensor-parallel worker (`python -m radix_backend.model_executor.tp_worker SPEC`).

Rank 0 starts one per extra rank (radix_backend/model_executor/distributed.py). The worker builds its rank's
ModelRunner from the same EngineConfig, which joins the process groups and serves rank 0's
forwards until rank 0 sends the stop message.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from ..config import EngineConfig
from .distributed import ENV_RANK
from .loader import resolve_checkpoint
from .model_runner import ModelRunner


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="radix-backend tensor-parallel worker (started by rank 0)")
    parser.add_argument("spec", help="JSON: model path, EngineConfig fields, tp_size, threads")
    spec = json.loads(parser.parse_args(argv).spec)
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {os.environ.get(ENV_RANK)}] %(levelname)s %(message)s")
    torch.set_num_threads(int(spec["threads"]))
    ModelRunner(resolve_checkpoint(spec["model"]), EngineConfig(**spec["config"]))  # serves, then exits


if __name__ == "__main__":
    if ENV_RANK not in os.environ:
        sys.exit("radix_backend.model_executor.tp_worker is started by the engine (Engine(tp_size=N)); do not run it directly")
    main(sys.argv[1:])
