"""router/placement.py GPU placement: each worker's CUDA_VISIBLE_DEVICES from --prefill-gpus / --decode-gpus,
the decode workers seeing the prefill GPUs they copy from, MPS only where roles share a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.router import cluster_cli
from pdserve.router.placement import gpu_lists, placement, roles_share_a_gpu


def test_prefill_and_decode_on_their_own_gpus() -> None:
    assert placement(["0"], ["1"], 1, 1) == {"prefill-0": "0", "decode-0": "1,0"}
    assert not roles_share_a_gpu(["0"], ["1"])


def test_several_workers_round_robin_and_decode_sees_every_prefill_gpu() -> None:
    env = placement(["0", "1"], ["2", "3"], 3, 2)
    assert env == {"prefill-0": "0", "prefill-1": "1", "prefill-2": "0", "decode-0": "2,0,1", "decode-1": "3,0,1"}


def test_roles_on_one_gpu_share_it_and_one_list_serves_both() -> None:
    assert placement(["1"], None, 1, 2) == {"prefill-0": "1", "decode-0": "1", "decode-1": "1"}
    assert roles_share_a_gpu(["0", "1"], ["1"]) and roles_share_a_gpu(None, None)
    assert placement(None, None, 1, 1) == {}  # the default: every process sees what the shell does


@pytest.mark.parametrize("spec", [",", " , "])
def test_an_empty_gpu_list_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="no GPU"):
        gpu_lists(spec)


@pytest.mark.parametrize(
    ("flags", "window_ms"), [(["--device", "cuda"], "1000"), ([], "0"), (["--busy-poll-ms", "5"], "5")]
)
def test_every_process_gets_the_same_busy_poll_window(flags: list[str], window_ms: str, tmp_path: Path) -> None:
    args, rest = cluster_cli.parse_args(cluster_cli.build_parser(), ["--model", "m", *flags])
    children = cluster_cli.plan_cluster(args, rest, tmp_path).children
    assert [c.name for c in children] == ["router", "prefill-0", "decode-0"]
    for child in children:
        assert child.argv[child.argv.index("--busy-poll-ms") + 1] == window_ms
