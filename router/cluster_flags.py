"""Which process takes which flag: what the launcher's own parser leaves of its command line, shared out among
its children's parsers.

pdserve-cluster (router/cluster_cli.py) parses only cluster-level flags. Every other flag goes, with its value,
to each kind of child whose own parser defines it (the router's, router/cli.py; the workers', core/cli.py), so a
flag added there can be set through the launcher with no change here. A flag no child parser defines, or one
the launcher sets itself for each child (--worker-id, --tp-size, ...), or one a child hides from its help (set
by a process for its own children, e.g. --tp-rank) is refused; so is a final argv that its child's parser or
checks would refuse. All of it happens before any process starts, and every message names the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from pdserve.core.cli import add_worker_args, worker_args_error
from pdserve.router.cli import add_router_args, router_args_error


class ArgvError(ValueError):
    """A command line that a parser refuses; the message names the flag."""


class CheckingParser(argparse.ArgumentParser):
    """Raises ArgvError where ArgumentParser would print its usage and exit: the launcher checks its children's
    command lines with it and reports any problem as its own."""

    def error(self, message: str) -> NoReturn:
        raise ArgvError(message)


@dataclass(frozen=True)
class ChildCli:
    """The command line of one kind of child process."""

    kind: str
    """"router" or "worker" (prefill and decode workers share one parser)."""
    prog: str
    """How the child is started, for messages."""
    add_args: Callable[[argparse.ArgumentParser], None]
    """Adds the child's flags to a parser (what its entry point calls)."""
    check: Callable[[argparse.Namespace], str | None]
    """The child's checks past argparse's: what is wrong, or None."""

    def parser(self) -> CheckingParser:
        # NOTE: no -h: a -h on the launcher's command line is the launcher's own
        parser = CheckingParser(prog=self.prog, add_help=False)
        self.add_args(parser)
        return parser

    def options(self) -> dict[str, argparse.Action]:
        """Each option string of the child, e.g. "--num-blocks", and its action."""
        # NOTE: argparse has no public list of a parser's actions; _actions is what its own help walks
        return {option: action for action in self.parser()._actions for option in action.option_strings}

    def internal(self) -> set[str]:
        """Option strings hidden from the child's help: a process sets them for its own children only."""
        return {option for option, action in self.options().items() if action.help == argparse.SUPPRESS}

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """argv (no program name) as the child will parse and check it; ArgvError naming the child and flag."""
        try:
            args = self.parser().parse_args(argv)
        except ArgvError as exc:
            raise ArgvError(f"{self.prog}: {exc}") from None
        if (problem := self.check(args)) is not None:
            raise ArgvError(f"{self.prog}: {problem}")
        return args


ROUTER = ChildCli("router", "python -m pdserve.router", add_router_args, router_args_error)
WORKER = ChildCli("worker", "python -m pdserve.prefill_worker / decode_worker", add_worker_args, worker_args_error)
CHILD_CLIS = (ROUTER, WORKER)


def split_flags(argv: list[str], set_by_launcher: Mapping[str, set[str]]) -> dict[str, list[str]]:
    """argv -> each kind of child's share of it, in order: every flag, with its value, goes to each kind whose
    parser defines it. set_by_launcher: kind -> the option strings the launcher writes for each child of that kind.
    ArgvError: a token that is no child's flag, a flag the launcher or a child sets itself, a flag without its
    value."""
    options = {cli.kind: cli.options() for cli in CHILD_CLIS}
    internal = {option for cli in CHILD_CLIS for option in cli.internal()}
    shares: dict[str, list[str]] = {kind: [] for kind in options}
    i = 0
    while i < len(argv):
        flag, inline, _ = argv[i].partition("=")
        owners = [kind for kind, known in options.items() if flag in known]
        if not owners:
            raise ArgvError(
                f"unrecognized arguments: {argv[i]} (a flag of neither pdserve-cluster, {ROUTER.prog} nor "
                f"{WORKER.prog})"
            )
        if flag in internal:
            raise ArgvError(f"argument {flag}: internal, set by a process for the processes it starts")
        if any(flag in set_by_launcher.get(kind, set()) for kind in owners):
            raise ArgvError(f"argument {flag}: set by pdserve-cluster itself for each process it starts")
        end = i + 1 + num_values(options[owners[0]][flag], bool(inline))
        if end > len(argv):
            raise ArgvError(f"argument {flag}: expected a value")
        for kind in owners:
            shares[kind] += argv[i:end]
        i = end
    return shares


def num_values(action: argparse.Action, inline: bool) -> int:
    """How many tokens after the flag are its values (none when it came as --flag=value)."""
    if inline or action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    # NOTE: with nargs "?", "*" or "+" the next tokens might be the value or the next flag: no such child flags
    raise TypeError(f"{action.option_strings[0]}: pdserve-cluster cannot route a flag with nargs={action.nargs!r}")
