from __future__ import annotations

import argparse
import sys

from pdserve.core.config import EngineConfig
from pdserve.core.rank_group import RankGroup
from pdserve.core.worker_main import main
from pdserve.prefill_worker.rank import PrefillRank
from pdserve.prefill_worker.worker import PrefillWorker


def _build(cfg: EngineConfig, args: argparse.Namespace, group: RankGroup | None) -> PrefillWorker:
    return PrefillWorker(
        cfg,
        args.worker_id,
        args.run_dir,
        args.num_decode,
        args.transport,
        args.heartbeat_interval,
        group=group,
        num_frontends=args.num_frontends,
    )


if __name__ == "__main__":
    sys.exit(main("prefill", _build, PrefillRank))
