from __future__ import annotations

import argparse
import sys

from pdserve.core.config import EngineConfig
from pdserve.core.worker_main import main
from pdserve.prefill_worker.worker import PrefillWorker


def _build(cfg: EngineConfig, args: argparse.Namespace) -> PrefillWorker:
    return PrefillWorker(cfg, args.worker_id, args.run_dir, args.num_decode, args.transport, args.heartbeat_interval)


if __name__ == "__main__":
    sys.exit(main("prefill", _build))
