"""Category scopes, timeline recording and the timeline plot."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from needle._core.errors import NeedleError
from needle.memory import categories as C
from needle.memory.caching_allocator import CachingAllocator
from needle.memory.timeline import (
    Event,
    op_scope,
    plot_timeline,
    record,
    set_current_op,
    timeline_series,
)


def test_resolution_order():
    assert C.current_category() == "other"
    with C.framework_category("activation"):
        assert C.resolve(None) == "activation"
        assert C.resolve("workspace") == "workspace"
        with C.category("weight"):
            assert C.resolve("workspace") == "weight"
            with C.framework_category("gradient"):
                assert C.current_category() == "weight"
        assert C.current_category() == "activation"
    assert C.current_category() == "other"


def test_unknown_category_raises_needle_error():
    with pytest.raises(NeedleError, match="expected one of .*got 'weights'"):
        C.category("weights")
    with pytest.raises(ValueError):
        C.framework_category("params")


def test_scope_is_restored_after_exception():
    with pytest.raises(RuntimeError):
        with C.category("optimizer"):
            raise RuntimeError("boom")
    assert C.current_category() == "other"


def test_categories_are_thread_local():
    seen = []
    with C.category("weight"):
        t = threading.Thread(target=lambda: seen.append(C.current_category()))
        t.start()
        t.join()
    assert seen == ["other"]


def test_listeners_follow_the_resolved_category():
    calls = []
    handle = C.add_listener(calls.append)
    try:
        with C.framework_category("activation"):
            with C.category("workspace"):
                pass
    finally:
        handle.remove()
    assert calls == ["activation", "workspace", "activation", "other"]
    with C.category("workspace"):
        pass
    assert len(calls) == 4  # removed: no more calls


def test_record_events_with_ops_and_categories():
    alloc = CachingAllocator("rec")
    keep = alloc.allocate(100)  # live before recording: part of the baseline
    with record(allocators=[alloc]) as events:
        with op_scope("matmul"), C.framework_category("activation"):
            a = alloc.allocate(1000)
        b = alloc.allocate(5000)
        alloc.retag(b, "gradient")
        a.release()
    after = alloc.allocate(1)  # recording stopped
    assert events.baseline["other"] == 512
    assert [(e.kind, e.nbytes, e.requested, e.category, e.op) for e in events] == [
        ("alloc", 1024, 1000, "activation", "matmul"),
        ("alloc", 5120, 5000, "other", None),
        ("retag", 5120, 5000, "gradient", None),
        ("free", 1024, 1000, "activation", None),
    ]
    assert events[2].prev_category == "other"
    assert [e.allocated_bytes for e in events] == [512 + 1024, 512 + 1024 + 5120,
                                                   512 + 1024 + 5120, 512 + 5120]
    assert events[0].new_segment is False  # carved from the segment `keep` opened
    for blk in (keep, b, after):
        blk.release()


def test_set_current_op_returns_previous():
    assert set_current_op("a") is None
    assert set_current_op("b") == "a"
    assert set_current_op(None) == "b"


def test_timeline_series_matches_manual_replay():
    events = [Event("alloc", "d", 512, 10, "weight", None, 1),
              Event("alloc", "d", 1024, 1000, "activation", None, 2),
              Event("retag", "d", 1024, 1000, "gradient", None, 2, prev_category="activation"),
              Event("free", "d", 512, 10, "weight", None, 1)]
    series = timeline_series(events, {"other": 2048})
    assert series["weight"].tolist() == [0, 512, 512, 512, 0]
    assert series["activation"].tolist() == [0, 0, 1024, 0, 0]
    assert series["gradient"].tolist() == [0, 0, 0, 1024, 1024]
    assert series["other"].tolist() == [2048] * 5
    total = sum(series.values())
    assert total.tolist() == [2048, 2560, 3584, 3584, 3072]


def test_plot_timeline_writes_png(tmp_path):
    alloc = CachingAllocator("plot")
    with record(allocators=[alloc]) as events:
        blocks = []
        for cat in ("weight", "activation", "activation", "gradient"):
            with C.category(cat):
                blocks.append(alloc.allocate(4096))
        for blk in blocks[1:3]:
            blk.release()
    out = plot_timeline(events, tmp_path / "t.png", title="demo")
    data = (tmp_path / "t.png").read_bytes()
    assert out.endswith("t.png") and data[:8] == b"\x89PNG\r\n\x1a\n"
    total = sum(timeline_series(events).values())
    assert int(np.argmax(total)) == 4 and total.max() == 4 * 4096
    for blk in (blocks[0], blocks[3]):
        blk.release()
