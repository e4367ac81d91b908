"""router/liveness.py and router/metrics.py with TP groups: a group is one worker, up from its rank 0's heartbeat
with its ranks listed; the group fields of a KV layout fingerprint may differ between workers, no other field."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.core import GaugeMetricFamily

from pdserve.core.gc_pauses import GcPauses
from pdserve.core.messages import HeartbeatEvent
from pdserve.router.liveness import Change, LayoutMismatch, Liveness
from pdserve.router.metrics import HubCollector

LAYOUT = {"model": "m", "dtype": "bfloat16", "block_size": 16, "num_layers": 2, "num_kv_heads": 4, "head_dim": 64}


def beat(role: str, worker: int, pid: int, ranks: list[int], **layout: Any) -> HeartbeatEvent:
    hb = HeartbeatEvent(role, worker, pid, f"inc-{pid}", 10, 16, 0, 0)
    return dataclasses.replace(hb, ranks=ranks, layout={**LAYOUT, **layout})


def group(tp_size: int) -> dict[str, Any]:
    """The group fields of a worker of tp_size ranks over LAYOUT's 4 KV heads."""
    per_rank = 4 // tp_size
    return {"tp_size": tp_size, "kv_head_ranges": [[r * per_rank, per_rank] for r in range(tp_size)]}


def test_prefill_tp_2_and_decode_tp_1_are_both_up() -> None:
    live = Liveness(1, 2, timeout=2.0, expected_layout={"block_size": 16})
    assert live.observe(beat("prefill", 0, 100, [100, 101], **group(2)), now=0.0) == [Change("prefill", 0, "up")]
    assert live.observe(beat("decode", 0, 200, [], **group(1)), now=0.1) == [Change("decode", 0, "up")]
    assert live.observe(beat("decode", 1, 300, [300, 301, 302, 303], **group(4)), now=0.2) == [
        Change("decode", 1, "up")
    ]
    assert live.serving and live.up("decode") == [0, 1]


def test_a_worker_without_the_group_fields_still_matches() -> None:
    live = Liveness(1, 1, timeout=2.0)
    live.observe(beat("prefill", 0, 100, [100, 101], **group(2)), now=0.0)
    assert live.observe(beat("decode", 0, 200, []), now=0.1) == [Change("decode", 0, "up")]


@pytest.mark.parametrize(("field", "value"), [("dtype", "float32"), ("num_layers", 3), ("head_dim", 128)])
def test_every_other_field_must_still_agree(field: str, value: object) -> None:
    live = Liveness(1, 1, timeout=2.0)
    live.observe(beat("prefill", 0, 100, [100, 101], **group(2)), now=0.0)
    with pytest.raises(LayoutMismatch, match=f"decode worker 0 has another KV layout: {field} "):
        live.observe(beat("decode", 0, 200, [], **group(1), **{field: value}), now=0.1)
    assert live.up("decode") == []


def test_a_worker_lists_its_ranks_only_as_a_group() -> None:
    live = Liveness(1, 1, timeout=2.0)
    live.observe(beat("prefill", 0, 123, [123, 124]), now=0.0)
    live.observe(beat("decode", 0, 200, []), now=0.0)
    prefill, decode = live.all_workers()
    assert (prefill.processes(), prefill.tp_size) == ("pid 123 ranks 123,124", 2)
    assert (decode.processes(), decode.tp_size) == ("pid 200", 1)


def test_the_router_exports_each_up_workers_tp_size() -> None:
    live = Liveness(2, 1, timeout=2.0)
    live.observe(beat("prefill", 0, 100, [100, 101]), now=0.0)
    live.observe(beat("decode", 0, 200, []), now=0.0)
    hub = SimpleNamespace(liveness=live, table=[], admission=[], num_migrations=0)
    gc_pauses = GcPauses()
    try:
        families = list(HubCollector(hub, gc_pauses).collect())  # type: ignore[arg-type]
    finally:
        gc_pauses.close()
    (tp,) = [f for f in families if f.name == "pdserve_worker_tp_size"]
    assert isinstance(tp, GaugeMetricFamily)
    assert [(s.labels, s.value) for s in tp.samples] == [
        ({"role": "prefill", "worker": "0"}, 2.0),
        ({"role": "decode", "worker": "0"}, 1.0),
    ]  # prefill-1 never beat: not up, no sample
