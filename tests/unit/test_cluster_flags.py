"""pdserve-cluster's command line (router/cluster_cli.py, router/cluster_flags.py): every flag of the router's and
the workers' parsers can be set through the launcher and lands in exactly the processes that define it; a flag
no process knows, a flag the launcher or a child sets itself or a bad value stops it at once, naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.router import cluster_cli
from pdserve.router.cluster_flags import CHILD_CLIS, ArgvError, ChildCli
from pdserve.router.supervisor import Child

LAUNCHER_SET = {"router": set(), "worker": {"--worker-id", "--num-prefill", "--num-decode", "--tp-size"}}
"""Child flags the launcher writes itself that are not its own flags: per child, or its own under other names."""


def plan(tmp_path: Path, *flags: str) -> list[Child]:
    """The children of `pdserve-cluster --model m --prefill 2 --decode 2 FLAGS`, started nowhere."""
    argv = ["--model", "m", "--prefill", "2", "--decode", "2", *flags]
    args, rest = cluster_cli.parse_args(cluster_cli.build_parser(), argv)
    return cluster_cli.plan_cluster(args, rest, tmp_path).children


def launcher_options() -> set[str]:
    return {s for action in cluster_cli.build_parser()._actions for s in action.option_strings}


def sample(action: argparse.Action) -> list[str]:
    """A valid value of a flag other than its default (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    if action.type is int:
        return ["3"]
    return ["0.5"] if action.type is float else ["x"]


FILE_FLAGS = {"--tls-cert": ["--tls-key"], "--tls-key": ["--tls-cert"], "--tls-client-ca": ["--tls-cert", "--tls-key"],
              "--api-key-file": []}  # fmt: skip
"""Flags whose value is a file that must exist, and the flags they need beside them."""


def with_files(flag: str, value: list[str], tmp_path: Path) -> tuple[list[str], list[str]]:
    """(value, other flags) that make flag valid: a file for a FILE_FLAGS flag, with its companions."""
    if flag not in FILE_FLAGS:
        return value, []
    path = tmp_path / "file.pem"
    path.write_text("k")
    return [str(path)], [token for other in FILE_FLAGS[flag] for token in (other, str(path))]


def holds(argv: list[str], tokens: list[str]) -> bool:
    """Whether tokens (a flag and its value) stand together in argv."""
    return any(argv[i : i + len(tokens)] == tokens for i in range(len(argv)))


def kind(child: Child) -> str:
    return cluster_cli.cli_of(child).kind


@pytest.mark.parametrize("cli", CHILD_CLIS, ids=lambda cli: cli.kind)
def test_every_child_flag_is_owned_set_or_routed_by_the_launcher(cli: ChildCli, tmp_path: Path) -> None:
    owned = launcher_options()
    defaults = plan(tmp_path)
    for flag, action in cli.options().items():
        if flag in cli.internal():  # set by a process for its own children (rank 0 for its TP ranks)
            assert not any(flag in c.argv for c in defaults), flag
            with pytest.raises(ArgvError, match=f"argument {flag}: internal"):
                plan(tmp_path, flag, *sample(action))
            continue
        receivers = [c for c in defaults if kind(c) == cli.kind]
        if flag in owned or flag in LAUNCHER_SET[cli.kind]:  # the launcher writes it for each such child
            assert all(flag in c.argv for c in receivers), (flag, [c.name for c in receivers if flag not in c.argv])
            if flag not in owned:
                with pytest.raises(ArgvError, match=f"argument {flag}: set by pdserve-cluster"):
                    plan(tmp_path, flag, *sample(action))
            continue
        value, others = with_files(flag, sample(action), tmp_path)
        children = plan(tmp_path, flag, *value, *others)
        defined_by = {c.kind for c in CHILD_CLIS if flag in c.options()}
        for child in children:
            if kind(child) in defined_by:
                assert child.argv.count(flag) == 1 and holds(child.argv, [flag, *value]), (flag, child.name)
            else:
                assert flag not in child.argv, (flag, child.name)


def test_the_launcher_sets_only_the_flags_it_names(tmp_path: Path) -> None:
    """LAUNCHER_SET above is what plan_cluster refuses: a child flag the launcher starts writing shows here."""
    owned = launcher_options()
    for cli in CHILD_CLIS:
        written = {t for c in plan(tmp_path) if kind(c) == cli.kind for t in c.argv if t in cli.options()}
        assert written - owned == LAUNCHER_SET[cli.kind]


def test_router_flags_reach_the_router_only(tmp_path: Path) -> None:
    flags = ["--max-queue-skew", "4", "--local-prefill-threshold=32", "--heartbeat-timeout", "1.5", "--grace", "9"]
    children = plan(tmp_path, *flags, "--conditional-disagg", "--num-blocks", "64")
    router, workers = children[0], children[1:]
    assert router.argv[-8:] == [*flags, "--conditional-disagg"]
    assert all(w.argv[-2:] == ["--num-blocks", "64"] and "--grace" not in w.argv for w in workers)


def test_the_router_grace_is_the_supervisors_stop_timeout(tmp_path: Path) -> None:
    args, rest = cluster_cli.parse_args(cluster_cli.build_parser(), ["--model", "m", "--grace", "7.5"])
    assert cluster_cli.plan_cluster(args, rest, tmp_path).grace == 7.5
    args, rest = cluster_cli.parse_args(cluster_cli.build_parser(), ["--model", "m"])
    assert cluster_cli.plan_cluster(args, rest, tmp_path).grace == 5.0


def test_colocated_and_roles_shape_the_children(tmp_path: Path) -> None:
    assert [c.name for c in plan(tmp_path, "--colocated")] == ["router", "decode-0", "decode-1"]
    assert [c.name for c in plan(tmp_path, "--roles", "prefill-1,decode-0")] == ["prefill-1", "decode-0"]


def test_frontends_start_router_processes_on_one_port_that_the_workers_all_answer(tmp_path: Path) -> None:
    children = plan(tmp_path, "--frontends", "3", "--port", "6000", "--metrics-port", "9400")
    routers = [c for c in children if c.role == "router"]
    assert [c.name for c in routers] == ["router-0", "router-1", "router-2"]
    for k, router in enumerate(routers):
        assert holds(router.argv, ["--port", "6000"]) and holds(router.argv, ["--frontend", str(k)])
        assert holds(router.argv, ["--num-frontends", "3"]) and router.log_path.name == f"router-{k}.log"
    metrics = [r.argv[r.argv.index("--metrics-port") + 1] for r in routers]
    assert metrics == ["9400", "9405", "9406"]  # router-0 as one router; the others after prefill 0-1, decode 0-1
    assert all(holds(w.argv, ["--num-frontends", "3"]) for w in children if w.role != "router")
    assert not any("--num-frontends" in c.argv for c in plan(tmp_path))  # one router: today's command lines
    only = plan(tmp_path, "--frontends", "2", "--roles", "router,decode-1")
    assert [c.name for c in only] == ["router-0", "router-1", "decode-1"]


def test_each_worker_gets_its_share_of_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def threads(children: list[Child]) -> dict[str, str]:
        return {c.name: c.argv[c.argv.index("--cpu-threads") + 1] for c in children if c.name != "router"}

    monkeypatch.setattr(cluster_cli.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert set(threads(plan(tmp_path)).values()) == {"2"}  # 8 cores, 4 workers
    assert threads(plan(tmp_path, "--roles", "router,prefill-1,decode-0")) == {"prefill-1": "4", "decode-0": "4"}
    assert set(threads(plan(tmp_path, "--cpu-threads", "0")).values()) == {"0"}  # torch's own default
    assert "--cpu-threads" not in plan(tmp_path)[0].argv
    monkeypatch.setattr(cluster_cli.os, "sched_getaffinity", lambda pid: {0, 1})
    assert set(threads(plan(tmp_path)).values()) == {"1"}  # never 0: that would mean torch's default


def test_the_cores_are_shared_over_every_tp_rank_started_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def threads(*flags: str) -> set[str]:
        return {c.argv[c.argv.index("--cpu-threads") + 1] for c in plan(tmp_path, *flags) if c.name != "router"}

    monkeypatch.setattr(cluster_cli.os, "sched_getaffinity", lambda pid: set(range(24)))
    assert threads("--prefill-tp", "2") == {"4"}  # 2 x 2 prefill ranks + 2 decode ranks
    assert threads("--tp", "2") == {"3"}  # 8 ranks
    assert threads("--tp", "3", "--decode-tp", "1") == {"3"}  # 6 + 2
    assert threads("--tp", "2", "--roles", "prefill-0") == {"12"}
    assert threads("--tp", "4", "--colocated") == {"3"}  # 2 decode workers of 4
    monkeypatch.setattr(cluster_cli.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads("--tp", "4") == {"1"}


@pytest.mark.parametrize(
    ("flags", "prefill_tp", "decode_tp"),
    [
        ([], "1", "1"),
        (["--tp", "2"], "2", "2"),
        (["--prefill-tp", "2"], "2", "1"),
        (["--decode-tp", "4"], "1", "4"),
        (["--tp", "4", "--decode-tp", "2"], "4", "2"),
        (["--tp", "2", "--prefill-tp", "1", "--decode-tp", "8"], "1", "8"),
        (["--prefill-tp", "2", "--transport", "dist"], "2", "1"),
    ],
)
def test_each_worker_gets_the_tp_size_of_its_role(
    flags: list[str], prefill_tp: str, decode_tp: str, tmp_path: Path
) -> None:
    workers = {c.name: c.argv for c in plan(tmp_path, *flags) if c.name != "router"}
    assert list(workers) == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    for name, argv in workers.items():
        assert argv.count("--tp-size") == 1 and "--tp-rank" not in argv
        assert argv[argv.index("--tp-size") + 1] == (prefill_tp if name.startswith("prefill") else decode_tp), name
    assert "--tp-size" not in plan(tmp_path, *flags)[0].argv


def test_colocated_tp_is_the_decode_workers(tmp_path: Path) -> None:
    children = plan(tmp_path, "--colocated", "--tp", "2")
    assert [(c.name, c.argv[c.argv.index("--tp-size") + 1]) for c in children[1:]] == [
        ("decode-0", "2"),
        ("decode-1", "2"),
    ]


def test_tp_groups_get_their_gpus(tmp_path: Path) -> None:
    flags = ["--model", "m", "--prefill", "1", "--prefill-tp", "2", "--decode", "1", "--decode-tp", "2"]
    args, _ = cluster_cli.parse_args(
        cluster_cli.build_parser(), [*flags, "--prefill-gpus", "0,1", "--decode-gpus", "2,3"]
    )
    assert args.gpus == {"prefill-0": "0,1", "decode-0": "2,3,0,1"}
    assert cluster_cli._mps(args, tmp_path) is None  # --mps auto on cpu; the roles share no GPU either
    args, _ = cluster_cli.parse_args(
        cluster_cli.build_parser(), [*flags, "--device", "cuda", "--prefill-gpus", "0,1", "--decode-gpus", "0,1"]
    )
    assert args.gpus == {"prefill-0": "0,1", "decode-0": "0,1"}
    assert cluster_cli._mps(args, tmp_path) is not None  # both roles on 0,1: MPS splits the SMs


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--max-q", "3"], "unrecognized arguments: --max-q"),  # no abbreviations: a prefix reaches nobody
        (["--num-blocks", "64", "stray"], "unrecognized arguments: stray"),
        (["--worker-id", "3"], "argument --worker-id: set by pdserve-cluster"),
        (["--num-decode", "2"], "argument --num-decode: set by pdserve-cluster"),
        (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
        (["--num-blocks", "many"], "argument --num-blocks: invalid int value"),
        (["--num-blocks", "1"], "--num-blocks >= 2"),
        (["--cpu-threads", "-1"], "--cpu-threads must be >= 0"),
        (["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be > 0"),
        (["--routing", "random"], "argument --routing: invalid choice"),
        (["--grace"], "argument --grace: expected a value"),
        (["--roles", "decode-7"], "--roles: unknown roles ['decode-7']"),
        (["--mps-split", "half"], "--mps-split 'half'"),
        (["--tp-size", "2"], "argument --tp-size: set by pdserve-cluster"),
        (["--tp-rank", "1"], "argument --tp-rank: internal"),
        (["--tp", "0"], "--tp must be >= 1 (got 0)"),
        (["--decode-tp", "-1"], "--decode-tp must be >= 1 (got -1)"),
        (["--colocated", "--prefill-tp", "2"], "--prefill-tp: --colocated has no prefill workers"),
        (["--prefill-gpus", "0", "--prefill-tp", "2"], "--prefill-gpus 0: 1 GPU(s), fewer than --prefill-tp 2"),
        (["--prefill-gpus", "0,1", "--tp", "4"], "--prefill-gpus 0,1: 2 GPU(s), fewer than --prefill-tp 4"),
        (["--decode-gpus", "3", "--tp", "2"], "--decode-gpus 3: 1 GPU(s), fewer than --prefill-tp 2"),
        (["--frontends", "2", "--port", "0"], "more than 1 need a fixed --port"),
        (["--frontends", "0"], "--frontends must be in [1, 64]"),
    ],
)
def test_a_bad_command_line_stops_the_launcher_before_anything_starts(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        cluster_cli.main(["--model", "m", "--run-dir", str(run_dir), *flags])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("pdserve-cluster: error: ") and needle in lines[-1], lines[-1]
    assert not run_dir.exists(), "the launcher made its run dir before it checked the command line"
