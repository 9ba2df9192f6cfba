"""The C++ caching allocator of ndarray_backend_cpu: byte accounting, categories, events.

The Python ``CachingAllocator`` (needle/memory/caching_allocator.py) is the oracle: the same
sequence of requests must give the same statistics, step by step. Those comparisons need an
allocator nobody else has touched, so they run in a fresh interpreter (this file run as a
script); the other tests work on differences of the shared allocator's counters.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

try:
    from needle.backend_ndarray import ndarray_backend_cpu as cpu
except ImportError:  # pragma: no cover - depends on the build
    pytest.skip("compiled module ndarray_backend_cpu is missing: build it with `pip install -e .`",
                allow_module_level=True)

from needle._core.errors import MemoryArgumentError, NeedleError, OutOfMemoryError
from needle.memory.caching_allocator import CachingAllocator
from needle.memory.categories import CATEGORIES
from needle.memory.timeline import Event

KiB, MiB = 1024, 1024 * 1024


# ---- scenarios replayed on both allocators (in a fresh interpreter) ------------------------
# Steps: ["a", name, nbytes, category] allocate; ["f", name] free; ["t", name, category] retag;
# ["e"] empty_cache; ["r"] reset_peak. Sizes are even: the C++ side allocates float16 Arrays.
SCENARIOS = {
    "rounding": [["a", "z", 0, "other"], ["a", "one", 2, "other"], ["a", "b512", 512, "weight"],
                 ["a", "b514", 514, "weight"], ["f", "one"], ["f", "b514"], ["f", "z"],
                 ["f", "b512"], ["e"]],
    "exact_reuse": [["a", "x", 4000, "activation"], ["f", "x"], ["a", "y", 4000, "gradient"],
                    ["f", "y"], ["a", "z", 3586, "other"], ["f", "z"]],
    "best_fit_split": [["a", "a", 100 * KiB, "other"], ["a", "b", 10 * KiB, "other"],
                       ["a", "c", 50 * KiB, "other"], ["a", "d", 10 * KiB, "other"],
                       ["f", "a"], ["f", "c"], ["a", "e", 40 * KiB, "other"],
                       ["a", "g", 60 * KiB, "other"], ["a", "h", 30 * KiB, "other"],
                       ["f", "e"], ["f", "g"], ["f", "h"], ["f", "b"], ["f", "d"], ["e"]],
    "coalesce": [["a", "a", 300 * KiB, "weight"], ["a", "b", 300 * KiB, "weight"],
                 ["a", "c", 300 * KiB, "weight"], ["f", "a"], ["f", "c"], ["f", "b"],
                 ["a", "d", 2 * MiB - 512, "other"], ["f", "d"], ["e"]],
    "large_pool": [["a", "l1", 3 * MiB // 2, "weight"], ["a", "l2", 3 * MiB + 2, "weight"],
                   ["a", "l3", 5 * MiB, "optimizer"], ["a", "l4", 9 * MiB // 2, "gradient"],
                   ["f", "l3"], ["a", "l5", 3 * MiB, "other"], ["f", "l4"],
                   ["a", "l6", 3 * MiB, "other"], ["a", "s", 1 * MiB, "other"],
                   ["f", "l1"], ["f", "l2"], ["f", "l5"], ["f", "l6"], ["f", "s"], ["e"]],
    "empty_cache_partial": [["a", "a", 600 * KiB, "other"], ["a", "b", 600 * KiB, "other"],
                            ["a", "c", 600 * KiB, "other"], ["a", "d", 600 * KiB, "other"],
                            ["a", "L", 4 * MiB, "other"], ["a", "M", 4 * MiB, "other"],
                            ["f", "a"], ["f", "b"], ["f", "c"], ["f", "M"], ["e"], ["f", "d"],
                            ["f", "L"], ["e"]],
    "retag_peaks": [["a", "w", 8 * KiB, "activation"], ["a", "v", 20 * KiB, "activation"],
                    ["t", "w", "weight"], ["r"], ["t", "w", "weight"], ["f", "v"],
                    ["a", "u", 2 * KiB, "gradient"], ["t", "u", "optimizer"], ["r"],
                    ["f", "u"], ["f", "w"]],
}


def _random_scenario(seed: int, steps: int) -> list:
    rng = np.random.default_rng(seed)
    live, out = [], []
    for i in range(steps):
        r = rng.random()
        if r < 0.45 or not live:
            big = rng.random() < 0.1
            nbytes = 2 * int(rng.integers(0, 3 * MiB if big else 40 * KiB))
            cat = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
            out.append(["a", f"x{i}", nbytes, cat])
            live.append(f"x{i}")
        elif r < 0.85:
            out.append(["f", live.pop(int(rng.integers(len(live))))])
        elif r < 0.95:
            out.append(["t", live[int(rng.integers(len(live)))],
                        CATEGORIES[int(rng.integers(len(CATEGORIES)))]])
        else:
            out.append(["e"] if rng.random() < 0.5 else ["r"])
    return out + [["f", name] for name in live] + [["e"]]


# ["l", bytes or None] sets a limit on reserved bytes; an "a" step past it records the refusal.
SCENARIOS["limit"] = [
    ["l", 4 * MiB], ["a", "a", 1 * MiB, "other"], ["a", "b", 1 * MiB, "other"],
    ["a", "c", 3 * MiB, "weight"],            # a 4 MiB segment would make 6 MiB: refused
    ["f", "a"], ["a", "d", 600 * KiB, "other"], ["a", "e", 700 * KiB, "other"],  # 4 MiB: fits
    ["a", "g", 900 * KiB, "other"],
    ["a", "h", 800 * KiB, "activation"],      # 872 KiB free in two pieces: fragmented, refused
    ["l", None], ["a", "h", 800 * KiB, "activation"], ["f", "h"], ["f", "b"], ["f", "d"],
    ["f", "e"], ["f", "g"], ["l", 4 * MiB],
    ["a", "x", 3 * MiB, "other"],             # the cached segments are returned first: fits
    ["f", "x"], ["l", None], ["e"]]
OOM_KEYS = ("requested", "block", "segment", "allocated", "reserved", "limit",
            "largest_free_block", "category")
SCENARIOS["random_1"] = _random_scenario(1, 400)
SCENARIOS["random_2"] = _random_scenario(2, 400)


def _replay_python(steps: list) -> tuple[list, list]:
    from needle.memory.timeline import record
    alloc = CachingAllocator("cpu")
    blocks, snaps = {}, []
    with record(allocators=[alloc]) as events:
        for step in steps:
            refused = None
            if step[0] == "a":
                try:
                    blocks[step[1]] = alloc.allocate(step[2], category=step[3])
                except OutOfMemoryError as err:
                    refused = {k: err.details[k] for k in OOM_KEYS}
            elif step[0] == "l":
                alloc.set_limit(step[1])
            elif step[0] == "f":
                blocks.pop(step[1]).release()
            elif step[0] == "t":
                alloc.retag(blocks[step[1]], step[2])
            elif step[0] == "e":
                alloc.empty_cache()
            else:
                alloc.reset_peak()
            snaps.append(dict(alloc.stats(), refused=refused))
    return snaps, [list(e.__dict__.values()) for e in events]


def _replay_cpp(steps: list) -> tuple[list, list]:
    arrays, snaps = {}, []
    cpu.allocator_record(True)
    cpu.allocator_set_oom_handler(lambda info: OutOfMemoryError("refused", dict(info)))
    for step in steps:
        refused = None
        if step[0] == "a":
            try:
                arrays[step[1]] = cpu.Array(step[2] // 2, "float16", category=step[3])
            except OutOfMemoryError as err:
                refused = {k: err.details[k] for k in OOM_KEYS}
        elif step[0] == "l":
            cpu.allocator_set_limit(step[1])
        elif step[0] == "f":
            del arrays[step[1]]
        elif step[0] == "t":
            arrays[step[1]].category = step[2]
        elif step[0] == "e":
            cpu.allocator_empty_cache()
        else:
            cpu.allocator_reset_peak()
        snaps.append(dict(cpu.allocator_stats(), refused=refused))
    cpu.allocator_record(False)
    return snaps, [list(Event(*t).__dict__.values()) for t in cpu.allocator_events()]


@pytest.fixture(scope="module")
def replayed():
    import needle
    root = os.path.dirname(os.path.dirname(os.path.abspath(needle.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    results = {}
    for name in SCENARIOS:  # one interpreter per scenario: both allocators start empty
        proc = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        results[name] = json.loads(proc.stdout)
    return results


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_statistics_match_python_allocator(replayed, name):
    res = replayed[name]
    assert len(res["cpu"]) == len(SCENARIOS[name])
    for i, (got, want) in enumerate(zip(res["cpu"], res["py"], strict=True)):
        want = dict(want, device="cpu")
        assert got == want, f"step {i}: {SCENARIOS[name][i]}"


@pytest.mark.parametrize("name", ["rounding", "coalesce", "retag_peaks", "random_1"])
def test_events_match_python_allocator(replayed, name):
    res = replayed[name]
    assert len(res["cpu_events"]) > 0
    assert res["cpu_events"] == res["py_events"]


def test_scenarios_hit_every_rule(replayed):
    """Guards the scenarios themselves: each rule they are named after actually happens."""
    last = {name: res["py"][-1] for name, res in replayed.items()}
    assert last["exact_reuse"]["num_reused"] == 2
    # The three freed neighbours merged back into one whole small segment (else empty_cache
    # could not return it); the 2 MiB - 512 B block lived in its own large segment.
    assert last["coalesce"]["num_segment_frees"] == 2
    large = replayed["large_pool"]["py"]
    assert large[0]["allocated_bytes"] == 2 * MiB  # 1.5 MiB block: remainder kept (not > 1 MiB)
    assert large[0]["requested_bytes"] == 3 * MiB // 2
    partial = replayed["empty_cache_partial"]["py"]
    assert 0 < partial[10]["reserved_bytes"] < partial[9]["reserved_bytes"]
    assert partial[-1]["reserved_bytes"] == 0
    limit = replayed["limit"]["py"]
    refused = [(i, s["refused"]) for i, s in enumerate(limit) if s["refused"]]
    assert [i for i, _ in refused] == [3, 8]
    big, frag = refused[0][1], refused[1][1]
    assert (big["segment"], big["reserved"], big["limit"]) == (4 * MiB, 2 * MiB, 4 * MiB)
    # fragmented: more bytes free in the cache than asked, but no free block that big
    assert frag["reserved"] - frag["allocated"] >= frag["block"] > frag["largest_free_block"]
    assert limit[-4]["refused"] is None  # the cached free segments were returned instead
    assert limit[-4]["num_segment_frees"] == limit[-5]["num_segment_frees"] + 3


# ---- in-process tests on the shared allocator (differences of counters) -------------------
def _stats() -> dict:
    gc.collect()
    return cpu.allocator_stats()


def _rounded(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


@pytest.fixture
def no_resolver():
    prev = cpu.allocator_set_category_resolver(None)
    prev_state = cpu.allocator_set_category_state(None)
    prev_cat = cpu.allocator_set_category(None)
    yield
    cpu.allocator_set_category(prev_cat)
    cpu.allocator_set_category_state(prev_state)
    cpu.allocator_set_category_resolver(prev)


def test_stats_fields_match_python_allocator():
    got = cpu.allocator_stats()
    want = CachingAllocator("cpu").stats()
    assert set(got) == set(want)
    assert set(got["by_category"]) == set(CATEGORIES)
    for row in got["by_category"].values():
        assert set(row) == {"current", "peak", "current_requested", "peak_requested"}
    assert got["cached_bytes"] == got["reserved_bytes"] - got["allocated_bytes"]


def test_alloc_free_accounting(no_resolver):
    before = _stats()
    a = cpu.Array(1000, "float32")
    b = cpu.Array(3, "float64")
    mid = _stats()
    assert mid["allocated_bytes"] - before["allocated_bytes"] == _rounded(4000) + 512
    assert mid["requested_bytes"] - before["requested_bytes"] == 4000 + 24
    assert mid["num_allocs"] - before["num_allocs"] == 2
    other = mid["by_category"]["other"]["current"] - before["by_category"]["other"]["current"]
    assert other == _rounded(4000) + 512
    del a, b
    after = _stats()
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["requested_bytes"] == before["requested_bytes"]
    assert after["num_frees"] - before["num_frees"] == 2


def test_retag_moves_bytes_between_categories(no_resolver):
    a = cpu.Array(300, "float32", category="activation")
    before = _stats()["by_category"]
    a.category = "weight"
    assert a.category == "weight"
    cpu.allocator_retag(a, "optimizer")
    after = _stats()["by_category"]
    assert a.category == "optimizer"
    assert after["activation"]["current"] == before["activation"]["current"] - 1536
    assert after["activation"]["current_requested"] == (
        before["activation"]["current_requested"] - 1200)
    assert after["optimizer"]["current"] == before["optimizer"]["current"] + 1536
    assert after["weight"]["current"] == before["weight"]["current"]


def test_set_category_charges_new_arrays(no_resolver):
    assert cpu.allocator_set_category("gradient") is None
    try:
        before = _stats()["by_category"]
        a = cpu.Array(2000, "float32", category="workspace")  # the thread setting wins
        assert a.category == "gradient"
        assert _stats()["by_category"]["gradient"]["current"] == (
            before["gradient"]["current"] + 8192)
    finally:
        assert cpu.allocator_set_category(None) == "gradient"
    assert cpu.Array(10, category="workspace").category == "workspace"
    assert cpu.Array(10).category == "other"


def test_set_category_is_per_thread(no_resolver):
    seen = []
    cpu.allocator_set_category("weight")
    try:
        t = threading.Thread(target=lambda: seen.append(cpu.Array(10).category))
        t.start()
        t.join()
        assert cpu.Array(10).category == "weight"
    finally:
        cpu.allocator_set_category(None)
    assert seen == ["other"]


def test_resolver_decides_when_no_thread_category(no_resolver):
    hints = []

    def resolver(hint):
        hints.append(hint)
        return "activation" if hint is None else hint

    cpu.allocator_set_category_resolver(resolver)
    assert cpu.Array(10).category == "activation"
    assert cpu.Array(10, category="workspace").category == "workspace"
    assert hints == [None, "workspace"]
    cpu.allocator_set_category_resolver(lambda hint: "nonsense")
    with pytest.raises(MemoryArgumentError, match="nonsense"):
        cpu.Array(10)


def _state_cases():
    """(user scopes, framework scopes, op default, hint) combinations, each a name or None;
    a framework entry None is ``as_forward``."""
    return [((), (), None, None), ((), (), "activation", None), ((), ("gradient",), "activation",
            None), ((), ("gradient", None), "activation", None), ((), ("gradient", None), None,
            None), (("weight",), ("gradient",), "activation", None), ((), ("optimizer",), None,
            "workspace"), (("master",), (), None, "workspace"), ((), (), None, "workspace"),
            (("weight", "optimizer_temp"), ("gradient",), None, None)]


@pytest.mark.parametrize("user, framework, op, hint", _state_cases())
def test_state_resolution_in_cpp_matches_resolve(no_resolver, user, framework, op, hint):
    """C++ reads needle.memory's thread-local fields itself (no resolver call): it must give
    the category ``categories.resolve`` gives, for every order of precedence."""
    import contextlib

    from needle.memory import categories

    state = categories.thread_state()
    cpu.allocator_set_category_state(state)
    with contextlib.ExitStack() as stack:
        for name in user:
            stack.enter_context(categories.category(name))
        for name in framework:
            stack.enter_context(categories.framework_category(name) if name is not None
                                else categories.as_forward())
        state.op_category = op
        try:
            got = cpu.Array(10, "float32", category=hint).category
            fast = cpu.new_array(10, "float32").category if hint is None else got
            want = categories.resolve(hint)
        finally:
            state.op_category = None
    assert got == want and fast == want
    assert cpu.Array(10).category == "other"  # scopes closed: the fields are back to None


def test_state_resolution_is_per_thread_and_reads_names_by_value(no_resolver):
    from needle.memory import categories

    state = categories.thread_state()
    cpu.allocator_set_category_state(state)
    seen = []
    with categories.framework_category("gradient"):
        t = threading.Thread(target=lambda: seen.append(cpu.new_array(10, "float32").category))
        t.start()
        t.join()
        assert cpu.new_array(10, "float32").category == "gradient"
        state.op_category = "".join(["activ", "ation"])  # equal, but not the interned object
        try:
            with categories.as_forward():
                assert cpu.new_array(10, "float32").category == "activation"
            state.op_category = "activations"
            with categories.as_forward(), pytest.raises(MemoryArgumentError, match="activations"):
                cpu.new_array(10, "float32")
        finally:
            state.op_category = None
    assert seen == ["other"]


def test_new_array_is_array_by_another_call():
    a = cpu.new_array(6, "float64")
    assert isinstance(a, cpu.Array) and a.size == 6 and a.dtype == "float64"
    assert cpu.new_array(3, np.dtype("float16")).dtype == "float16"
    with pytest.raises(ValueError, match="float8"):
        cpu.new_array(3, "float8")


@pytest.mark.parametrize("call", [
    lambda: cpu.Array(4, category="weights"),
    lambda: cpu.allocator_set_category("Weight"),
    lambda: setattr(cpu.Array(4), "category", "grad"),
    lambda: cpu.allocator_retag(cpu.Array(4), 3),
])
def test_unknown_category_raises_naming_the_allowed_ones(no_resolver, call):
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, NeedleError)
    assert "expected one of ['weight', 'gradient', 'optimizer', 'master', 'optimizer_temp', " \
        "'activation'" in str(info.value)


def test_peak_and_reset_peak(no_resolver):
    # A free cached segment left by an earlier test could serve the 3 MiB request with a
    # larger block; start from an empty cache so the expected 4 MiB is this test's own.
    cpu.allocator_empty_cache()
    cpu.allocator_reset_peak()
    s = _stats()
    assert s["peak_bytes"] == s["allocated_bytes"]
    assert s["peak_reserved_bytes"] == s["reserved_bytes"]
    big = cpu.Array(3 * MiB // 4, "float32", category="optimizer")  # 3 MiB: a 4 MiB segment
    mid = _stats()
    del big
    after = _stats()
    assert after["peak_bytes"] == mid["allocated_bytes"] == s["allocated_bytes"] + 4 * MiB
    assert after["by_category"]["optimizer"]["peak"] == (
        s["by_category"]["optimizer"]["current"] + 4 * MiB)
    assert after["peak_requested_bytes"] == s["requested_bytes"] + 3 * MiB
    cpu.allocator_reset_peak()
    reset = _stats()
    assert reset["peak_bytes"] == reset["allocated_bytes"] == s["allocated_bytes"]
    assert reset["by_category"]["optimizer"]["peak"] == s["by_category"]["optimizer"]["current"]


def test_empty_cache_returns_only_whole_free_segments(no_resolver):
    cpu.allocator_empty_cache()
    keep = cpu.Array(5 * MiB // 4, "float32")   # 5 MiB block: its own 6 MiB segment
    gone = cpu.Array(7 * MiB // 4, "float32")   # 7 MiB block: its own 8 MiB segment
    cpu.fill(keep, 3.0)
    del gone
    before = _stats()
    released = cpu.allocator_empty_cache()
    after = _stats()
    assert released >= 8 * MiB
    assert before["reserved_bytes"] - after["reserved_bytes"] == released
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["reserved_bytes"] >= after["allocated_bytes"] + 0
    assert cpu.allocator_empty_cache() == 0  # nothing wholly free is left
    assert np.all(cpu.to_numpy(keep, (keep.size,), (1,), 0) == 3.0)


def test_events_record_alloc_retag_free_with_op(no_resolver):
    cpu.allocator_events(clear=True)
    assert cpu.allocator_record(True) is False
    try:
        assert cpu.allocator_set_op("MatMul") is None
        a = cpu.Array(250, "float32", category="activation")
        block = a.block_id
        a.category = "gradient"
        assert cpu.allocator_set_op("Relu.gradient") == "MatMul"
        del a
        cpu.allocator_set_op(None)
    finally:
        assert cpu.allocator_record(False) is True
    events = [Event(*t) for t in cpu.allocator_events() if t[6] == block]
    assert [(e.kind, e.category, e.prev_category, e.op) for e in events] == [
        ("alloc", "activation", None, "MatMul"), ("retag", "gradient", "activation", "MatMul"),
        ("free", "gradient", None, "Relu.gradient")]
    assert all((e.nbytes, e.requested, e.device) == (1024, 1000, "cpu") for e in events)
    cpu.Array(10)
    assert [t for t in cpu.allocator_events() if t[6] == block] == []  # log off, drained


def test_concurrent_python_threads_and_kernels_return_to_start(no_resolver):
    before = _stats()
    errors = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                n = int(rng.integers(1, 20000))
                a, b, out = (cpu.Array(n, "float32") for _ in range(3))
                cpu.fill(a, 1.0)
                cpu.fill(b, 2.0)
                cpu.ewise_add(a, b, out)  # releases the GIL
                m = int(rng.integers(1, 40))
                x, y, z = (cpu.Array(m * m, "float16") for _ in range(3))
                cpu.fill(x, 1.0)
                cpu.fill(y, 1.0)
                cpu.matmul(x, y, z, m, m, m)  # float16: a workspace from needle_alloc, no GIL
                if cpu.to_numpy(out, (n,), (1,), 0)[-1] != 3.0:
                    errors.append("ewise_add")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    cpu._allocator_stress(3, 20000, 7)  # C++ threads hammer the allocator meanwhile
    for t in threads:
        t.join()
    after = _stats()
    assert errors == []
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["requested_bytes"] == before["requested_bytes"]
    assert after["num_allocs"] - before["num_allocs"] == after["num_frees"] - before["num_frees"]
    for c in CATEGORIES:
        assert after["by_category"][c]["current"] == before["by_category"][c]["current"]


def test_no_leak_after_1000_cycles(no_resolver):
    def cycle():
        keep = [cpu.Array(n, "float32") for n in (10, 3000, 70000, 300000)]
        cpu.fill(keep[2], 1.0)
        keep[1].category = "weight"
        del keep[0]
        tmp = cpu.Array(5000)
        del keep, tmp

    cycle()
    first = _stats()
    for _ in range(1000):
        cycle()
    last = _stats()
    for key in ("allocated_bytes", "requested_bytes", "reserved_bytes", "num_segments"):
        assert last[key] == first[key], key
    assert last["num_segment_allocs"] == first["num_segment_allocs"]
    assert last["num_allocs"] - first["num_allocs"] == 5000
    assert last["num_reused"] - first["num_reused"] == 5000



def _planned_run(begin, requests):
    """Allocate float32 Arrays of ``requests`` bytes inside a planned run begun by ``begin``;
    returns their addresses relative to the first planned one, and plan_end's report."""
    begin()
    arrays = []
    try:
        for nbytes in requests:
            arrays.append(cpu.Array(nbytes // 4, "float32"))
    finally:
        count, first, reason = cpu.allocator_plan_end()
    base = arrays[0].ptr()
    return [a.ptr() - base for a in arrays], (count, first, reason)


@pytest.mark.parametrize("requests", [[1024, 2048, 512], [1024, 4096, 512]],
                         ids=["as-planned", "diverging"])
def test_a_prepared_plan_serves_what_the_list_does(requests):
    entries = [(1024, 0, 1024), (2048, 1024, 2048), (512, 3072, 512)]
    prepared = cpu.allocator_plan_prepare(4096, entries)
    assert len(prepared) == 3 and prepared.arena_bytes == 4096
    by_list = _planned_run(lambda: cpu.allocator_plan_begin(4096, entries), requests)
    by_prepared = _planned_run(lambda: cpu.allocator_plan_begin_prepared(prepared), requests)
    assert by_list == by_prepared
    if requests[1] == 2048:
        assert by_list == ([0, 1024, 3072], (3, -1, ""))
    else:
        assert by_list[1][1] == 1 and "4096" in by_list[1][2]
    again = _planned_run(lambda: cpu.allocator_plan_begin_prepared(prepared), requests)
    assert again == by_prepared  # a prepared plan is reusable: each run starts afresh


if __name__ == "__main__":  # fresh-interpreter replay used by the `replayed` fixture
    _main_name = sys.argv[1]
    cpu.allocator_set_category_resolver(None)
    cpu.allocator_set_category_state(None)
    assert cpu.allocator_stats()["num_allocs"] == 0, "the C++ allocator was used before"
    _cpu = _replay_cpp(SCENARIOS[_main_name])
    _py = _replay_python(SCENARIOS[_main_name])
    json.dump({"cpu": _cpu[0], "py": _py[0], "cpu_events": _cpu[1], "py_events": _py[1]},
              sys.stdout)
