"""router/placement.py with TP groups: a worker of TP size N gets N GPUs of its role's list, in order (rank r on
cuda:r); groups go round robin like single GPUs; a decode worker also sees every prefill GPU not in its group; a
list shorter than the TP size is refused, naming the flags; under MPS only workers sharing a GPU get an SM share."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pdserve.router.placement import (
    Mps,
    alone_on_their_gpus,
    compute_gpus,
    placement,
    roles_share_a_gpu,
    tp_groups,
    within_visible,
)


def test_each_role_on_its_own_gpu_pair() -> None:
    assert placement(["0", "1"], ["2", "3"], 1, 1, prefill_tp=2, decode_tp=2) == {
        "prefill-0": "0,1",
        "decode-0": "2,3,0,1",
    }
    assert not roles_share_a_gpu(["0", "1"], ["2", "3"])


def test_both_roles_on_one_gpu_pair_share_it() -> None:
    env = placement(["0", "1"], ["0", "1"], 1, 1, prefill_tp=2, decode_tp=2)
    assert env == {"prefill-0": "0,1", "decode-0": "0,1"}
    assert roles_share_a_gpu(["0", "1"], ["0", "1"])
    assert placement(["0", "1"], None, 1, 1, prefill_tp=2, decode_tp=2) == env  # one list serves both


def test_groups_go_round_robin_over_the_workers() -> None:
    env = placement(["0", "1", "2", "3"], ["4", "5"], 3, 2, prefill_tp=2)
    assert env == {
        "prefill-0": "0,1",
        "prefill-1": "2,3",
        "prefill-2": "0,1",
        "decode-0": "4,0,1,2,3",
        "decode-1": "5,0,1,2,3",
    }


def test_a_decode_group_lists_its_own_gpus_first_in_rank_order() -> None:
    env = placement(["3", "2"], ["2", "0", "1", "3"], 1, 2, prefill_tp=1, decode_tp=2)
    assert env == {"prefill-0": "3", "decode-0": "2,0,3", "decode-1": "1,3,2"}


def test_colocated_decode_groups_see_only_their_own_gpus() -> None:
    assert placement(None, ["0", "1", "2", "3"], 0, 2, decode_tp=2) == {"decode-0": "0,1", "decode-1": "2,3"}


def test_without_gpu_lists_every_worker_sees_every_gpu() -> None:
    assert placement(None, None, 2, 2, prefill_tp=2, decode_tp=4) == {}


def test_a_rest_shorter_than_a_group_stays_unused() -> None:
    assert tp_groups(["0", "1", "2"], 2, "--prefill-gpus", "--prefill-tp") == [["0", "1"]]
    assert tp_groups(["0", "1", "2"], 1, "--prefill-gpus", "--prefill-tp") == [["0"], ["1"], ["2"]]


@pytest.mark.parametrize(
    ("prefill", "decode", "prefill_tp", "decode_tp", "needle"),
    [
        (["0"], ["1", "2"], 2, 1, "--prefill-gpus 0: 1 GPU(s), fewer than --prefill-tp 2"),
        (["0", "1"], ["2"], 1, 2, "--decode-gpus 2: 1 GPU(s), fewer than --decode-tp 2"),
        (["0", "1"], None, 1, 4, "--prefill-gpus 0,1: 2 GPU(s), fewer than --decode-tp 4"),
        (None, ["0"], 2, 1, "--decode-gpus 0: 1 GPU(s), fewer than --prefill-tp 2"),
    ],
)
def test_a_gpu_list_shorter_than_its_tp_size_is_refused(
    prefill: list[str] | None, decode: list[str] | None, prefill_tp: int, decode_tp: int, needle: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        placement(prefill, decode, 1, 1, prefill_tp, decode_tp)


def test_under_mps_only_the_workers_sharing_a_gpu_get_an_sm_share(tmp_path: Path) -> None:
    shared = compute_gpus(["0", "1"], ["1"], 2, 1)  # 2P:1D-shared: prefill-1 and decode-0 split GPU 1
    assert shared == {"prefill-0": ["0"], "prefill-1": ["1"], "decode-0": ["1"]}
    assert alone_on_their_gpus(shared) == {"prefill-0"}
    mps = Mps(tmp_path, (70, 30), frozenset(alone_on_their_gpus(shared)))
    assert mps.worker_env("prefill-0", "prefill") == mps.env  # the MPS pipe, the whole GPU
    assert mps.worker_env("prefill-1", "prefill")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert mps.worker_env("decode-0", "decode")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert mps.worker_env("router", "router") == {}
    apart = compute_gpus(["0", "1"], ["2", "3"], 1, 1, prefill_tp=2, decode_tp=2)
    assert alone_on_their_gpus(apart) == {"prefill-0", "decode-0"}
    assert alone_on_their_gpus(compute_gpus(None, None, 1, 1)) == set()  # every GPU seen by all: shares for all


def test_under_mps_workers_name_their_gpus_by_uuid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster started with CUDA_VISIBLE_DEVICES=3: its daemon sees GPU 3 alone, so a worker's "3" would be read
    against the daemon's list (no such GPU); a UUID names the host's GPU 3 to both."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\nprintf '0, GPU-aaaa\\n3, GPU-dddd\\n'\n")
    (stubs / "nvidia-cuda-mps-control").write_text("#!/bin/sh\nexit 0\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    mps = Mps(tmp_path / "run", (50, 50), frozenset({"prefill-0"}))
    assert mps.start({"CUDA_VISIBLE_DEVICES": "3"})
    assert mps.worker_env("decode-0", "decode", "3")["CUDA_VISIBLE_DEVICES"] == "GPU-dddd"
    assert mps.worker_env("prefill-0", "prefill", "0, 3")["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-dddd"
    assert mps.worker_env("decode-0", "decode", "GPU-bbbb,7")["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb,7"  # kept
    assert "CUDA_VISIBLE_DEVICES" not in mps.worker_env("decode-0", "decode")  # every GPU the daemon sees
    assert mps.worker_env("router", "router", "3") == {}


def test_gpu_flags_index_the_launchers_visible_gpus() -> None:
    assert within_visible(["0", "1"], "2,3", "--prefill-gpus") == ["2", "3"]
    assert within_visible(["1", "GPU-aaaa"], "GPU-bbbb,GPU-cccc", "--decode-gpus") == ["GPU-cccc", "GPU-aaaa"]
    assert within_visible(["0", "1"], None, "--prefill-gpus") == ["0", "1"]  # the host's indices
    assert within_visible(None, "2,3", "--decode-gpus") is None
    with pytest.raises(ValueError, match=re.escape("--decode-gpus 2: CUDA_VISIBLE_DEVICES=2,3 shows 2 GPU(s)")):
        within_visible(["2"], "2,3", "--decode-gpus")
