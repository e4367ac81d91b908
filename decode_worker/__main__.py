from __future__ import annotations

import argparse
import sys

from pdserve.core.config import EngineConfig
from pdserve.core.rank_group import RankGroup
from pdserve.core.worker_main import main
from pdserve.decode_worker.rank import DecodeRank
from pdserve.decode_worker.worker import DecodeWorker


def _build(cfg: EngineConfig, args: argparse.Namespace, group: RankGroup | None) -> DecodeWorker:
    return DecodeWorker(
        cfg,
        args.worker_id,
        args.run_dir,
        args.num_prefill,
        args.transport,
        args.heartbeat_interval,
        group=group,
        num_frontends=args.num_frontends,
    )


if __name__ == "__main__":
    sys.exit(main("decode", _build, DecodeRank))
