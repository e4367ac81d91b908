"""`python -m pdserve.router`: the router process (see router/server.py; its flags: router/cli.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

from pdserve.core.lifecycle import STARTUP_ERROR_EXIT
from pdserve.router.cli import build_parser, config_from_args, router_args_error
from pdserve.router.config import RouterConfig
from pdserve.router.server import StartupError, serve


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = build_parser()
    args = p.parse_args(argv)
    if (error := router_args_error(args)) is not None:
        p.error(error)
    name = "router" if args.num_frontends == 1 else f"router-{args.frontend}"
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return config_from_args(args)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        asyncio.run(serve(cfg))
    except StartupError as exc:
        print(f"pdserve router: cannot start: {exc}", file=sys.stderr)
        return STARTUP_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
