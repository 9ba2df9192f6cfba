"""send_array/recv_array, the object calls and the one host-staging path, on thread ranks.

Arrays: every wire dtype, 0-d, empty and non-contiguous input, Tensors (the CUDA emulator's
too). Objects: the allowed types round-trip exactly; gather/all-gather with a different
object on every rank. Errors: refused types, refused dtypes, headers and encodings that are
forged, payloads over the limit, a message of the other kind, an abort, a tag out of range.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import needle.distributed as dist
from needle import DTypeError
from needle._core.dtypes import numpy_dtype
from needle.autograd import Tensor
from needle.distributed import _buffers, _wire, p2p, traffic
from needle.distributed._group import resolve

WIRE_DTYPES = list(_wire.DTYPES)


def _value(dtype: str, shape: tuple) -> np.ndarray:
    return (np.arange(math.prod(shape)).reshape(shape) % 7).astype(numpy_dtype(dtype))


def _pair(send, recv):
    """Rank 0 runs ``send()``, rank 1 returns ``recv()``."""
    def job(rank):
        if rank == 0:
            send()
            return None
        return recv()

    return dist.spawn_threads(job, 2)[1]


# ---- arrays --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5,), (2, 3, 4), (1,) * 8])
def test_recv_array_allocates_what_was_sent(dtype, shape):
    value = _value(dtype, shape)
    got = _pair(lambda: dist.send_array(value, 1, tag=5), lambda: dist.recv_array(0, tag=5))
    assert got.dtype == value.dtype and got.shape == value.shape
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("view", ["transposed", "strided", "negative", "fortran"])
def test_non_contiguous_input_arrives_in_logical_order(view):
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    value = {"transposed": base.T, "strided": base[::2, 1::3], "negative": base[::-1, ::-2],
             "fortran": np.asfortranarray(base)}[view]
    assert not value.flags.c_contiguous
    got = _pair(lambda: dist.send_array(value, 1), lambda: dist.recv_array(0))
    assert got.shape == value.shape
    np.testing.assert_array_equal(got, value)


def test_scalars_lists_and_tensors_are_sent_as_arrays():
    def send():
        dist.send_array(2.5, 1, tag=1)
        dist.send_array([[1, 2], [3, 4]], 1, tag=2)
        dist.send_array(np.float16(3), 1, tag=3)
        dist.send_array(Tensor(np.ones((2, 2), np.float32)), 1, tag=4)

    got = _pair(send, lambda: [dist.recv_array(0, tag=t) for t in (1, 2, 3, 4)])
    assert [(g.dtype.name, g.shape) for g in got] == [
        ("float64", ()), ("int64", (2, 2)), ("float16", ()), ("float32", (2, 2))]
    assert got[0] == 2.5 and got[1].tolist() == [[1, 2], [3, 4]] and got[3].sum() == 4


def test_array_messages_are_send_and_recv_messages():
    """One format: send_array's message fills a recv buffer; send's message a recv_array."""
    def send():
        dist.send_array(np.arange(3, dtype=np.int32), 1, tag=1)
        dist.send(np.full((2, 2), 7, np.float16), 1, tag=2)

    def recv():
        buf = np.zeros(3, np.int32)
        dist.recv(buf, 0, tag=1)
        return buf, dist.recv_array(0, tag=2)

    buf, arr = _pair(send, recv)
    assert buf.tolist() == [0, 1, 2] and arr.dtype == np.float16 and arr.tolist() == [[7, 7]] * 2


def test_the_sent_array_is_captured_when_sending_a_tensor():
    def send():
        t = Tensor(np.ones(4, np.float32))
        work = dist.isend_array(t, 1)
        t.data = Tensor(np.zeros(4, np.float32))
        work.wait()

    assert _pair(send, lambda: dist.recv_array(0)).tolist() == [1.0] * 4


def test_irecv_array_polls_and_then_returns_the_array():
    def job(rank):
        if rank == 1:
            work = dist.irecv_array(0, tag=9)
            assert not work.is_completed()  # rank 0 sends only after the barrier
            dist.barrier()
            return work.wait()
        dist.barrier()
        dist.send_array(np.eye(2), 1, tag=9)
        return None

    np.testing.assert_array_equal(dist.spawn_threads(job, 2)[1], np.eye(2))


def test_a_cancelled_receive_leaves_the_next_message_whole():
    """Cancelled before anything came: withdrawn. Cancelled after its header came: it still
    takes the payload. Either way the next receive on the tag gets a whole message (the
    thread transport delivers a message when it is sent)."""
    def job(rank):
        if rank == 0:
            dist.barrier()                      # 1: rank 1 cancelled a receive
            dist.send_object("early", 1, tag=1)
            dist.barrier()                      # 2: rank 1 posted another
            dist.send_object("x" * 20, 1, tag=1)
            dist.barrier()                      # 3: its header is in
            dist.barrier()                      # 4: rank 1 cancelled it
            dist.send_object("late", 1, tag=1)
            dist.send_object("y" * 30, 1, tag=1)
            return None
        dist.irecv_object(0, tag=1).cancel()
        dist.barrier()
        got = [dist.recv_object(0, tag=1, timeout=5)]
        arrived = dist.irecv_object(0, tag=1)
        dist.barrier()
        dist.barrier()
        arrived.cancel()
        dist.barrier()
        return got + [dist.recv_object(0, tag=1, timeout=5) for _ in range(2)]

    assert dist.spawn_threads(job, 2, timeout=20)[1] == ["early", "late", "y" * 30]


def test_traffic_counts_the_payload_and_the_header_apart():
    def job(rank):
        if rank == 0:
            dist.send_array(np.zeros((3, 5), np.float64), 1)
            dist.send_object({"a": 1}, 1)
        else:
            dist.recv_array(0)
            dist.recv_object(0)
        return [(r.kind, r.payload_bytes, r.predicted_sent, r.predicted_recv, r.sent, r.recv,
                 r.overhead_sent, r.overhead_recv) for r in traffic.ledger().records
                if r.kind in ("send", "recv")]

    send_rows, recv_rows = dist.spawn_threads(job, 2)
    obj = _wire.encode_object({"a": 1}, "t").size
    head = _wire.HEADER_BYTES
    assert send_rows == [("send", 120, 120, 0, 120, 0, head, 0),
                         ("send", obj, obj, 0, obj, 0, head, 0)]
    assert recv_rows == [("recv", 120, 0, 120, 0, 120, 0, head),
                         ("recv", obj, 0, obj, 0, obj, 0, head)]


# ---- objects -------------------------------------------------------------------------------
OBJECTS = [
    None, True, False, 0, -7, 2**80, -(2**70), 1.5, -0.0, float("inf"), float("-inf"), "",
    "snowman \u2603 and \U0001f600", b"", b"\x00\xffbytes", [], (), {}, [1, [2, [3, ()]]],
    (1, "a", None, (2.5,)), {"a": 1, 2: "b", "nested": {3: [4, {"x": (5,)}]}},
    {"tuple": [1], "dict": 2, "float": "nan", "bytes": "AA=="},  # user keys named as the tags
]


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: type(o).__name__)
def test_objects_round_trip_exactly(obj):
    got = _pair(lambda: dist.send_object(obj, 1, tag=2), lambda: dist.recv_object(0, tag=2))
    assert got == obj and type(got) is type(obj)
    if isinstance(obj, (dict, list, tuple)):
        assert repr(got) == repr(obj)  # nested types too (tuples stay tuples, int keys ints)


def test_nan_and_numpy_scalars_arrive_as_python_values():
    obj = [float("nan"), np.float32(0.5), np.int64(-3), np.bool_(True), np.uint8(200)]
    got = _pair(lambda: dist.send_object(obj, 1), lambda: dist.recv_object(0))
    assert math.isnan(got[0]) and got[1:] == [0.5, -3, True, 200]
    assert [type(v) for v in got] == [float, float, int, bool, int]


def test_the_object_is_captured_when_sending():
    def send():
        obj = {"step": 1}
        work = dist.isend_object(obj, 1)
        obj["step"] = 2
        work.wait()

    assert _pair(send, lambda: dist.recv_object(0)) == {"step": 1}


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_object_with_a_different_object_on_every_rank(world):
    def mine(rank):
        return [None, {"rank": 1, "names": ("a", "bb")}, "x" * 5000][rank]

    got = dist.spawn_threads(lambda rank: dist.all_gather_object(mine(rank)), world)
    assert got == [[mine(r) for r in range(world)]] * world
    assert isinstance(got[0][1]["names"], tuple)


@pytest.mark.parametrize("world,dst", [(2, 0), (2, 1), (3, 0), (3, 2)])
def test_gather_object_delivers_on_dst_only(world, dst):
    def mine(rank):
        return [[rank] * (10 * rank), {"r": rank}, (rank, b"\x01" * rank)][rank]

    got = dist.spawn_threads(lambda rank: dist.gather_object(mine(rank), dst=dst), world)
    assert got[dst] == [mine(r) for r in range(world)]
    assert [g for r, g in enumerate(got) if r != dst] == [None] * (world - 1)


def test_object_collectives_run_in_a_subgroup():
    def job(rank):
        sub = dist.new_group([0, 2])
        if rank == 1:
            return None
        return dist.all_gather_object(f"rank {rank}", group=sub), dist.gather_object(
            rank * 10, dst=1, group=sub)

    assert dist.spawn_threads(job, 3) == [(["rank 0", "rank 2"], None), None,
                                          (["rank 0", "rank 2"], [0, 20])]


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("obj,where,kind", [
    ({"a": [1, {2}]}, r"obj\['a'\]\[1\]", "builtins.set"),
    ((1, np.zeros(2)), r"obj\[1\]", "numpy.ndarray"),
    ([object()], r"obj\[0\]", "builtins.object"),
    ({"f": print}, r"obj\['f'\]", "builtins.builtin_function_or_method"),
])
def test_send_object_refuses_other_types_naming_where_and_what(obj, where, kind):
    def job(rank):
        with pytest.raises(dist.ObjectTypeError, match=rf"send_object: {where} has type "
                                                       rf"{kind}, expected one of None, bool"):
            dist.send_object(obj, 1 - rank)
        return True

    assert dist.spawn_threads(job, 2) == [True, True]


def test_subclasses_keys_and_cycles_are_refused():
    from collections import OrderedDict
    from enum import IntEnum

    class Color(IntEnum):
        RED = 1

    cycle: list = []
    cycle.append(cycle)
    cases = [(OrderedDict(a=1), "has type collections.OrderedDict"), (Color.RED, "Color"),
             ({(1, 2): 3}, "a key of obj has type tuple, expected str or int"),
             ({True: 3}, "a key of obj has type bool"), (cycle, "nested deeper than 64")]

    def job(rank):
        for obj, message in cases:
            with pytest.raises(dist.ObjectTypeError, match=message):
                dist.all_gather_object(obj)
        return True

    assert dist.spawn_threads(job, 1) == [True]
    assert issubclass(dist.ObjectTypeError, TypeError)


@pytest.mark.parametrize("dtype", ["complex64", "uint16", "object", "datetime64[s]"])
def test_send_array_refuses_dtypes_outside_the_format(dtype):
    value = np.zeros(2, dtype=dtype)

    def job(rank):
        with pytest.raises(DTypeError, match=r"send_array: unsupported dtype, expected one "
                           rf"of \['float32', .*'bool', 'bfloat16'\], got {dtype[:8]}"):
            dist.send_array(value, 1 - rank)
        return True

    assert dist.spawn_threads(job, 2) == [True, True]


def test_tag_out_of_range_is_refused():
    def job(rank):
        for call in (lambda: dist.send_array(np.zeros(1), 1 - rank, tag=-1),
                     lambda: dist.recv_object(1 - rank, tag=2**28)):
            with pytest.raises(dist.CommError, match=r"tag out of range, expected 0 <= tag < "
                                                     r"268435456, got (-1|268435456)"):
                call()
        return True

    assert dist.spawn_threads(job, 2) == [True, True]


def test_a_message_on_another_tag_is_not_taken():
    def job(rank):
        if rank == 0:
            dist.send_array(np.zeros(2), 1, tag=3)
            dist.barrier()  # stays in the group while rank 1 waits on the other tag
            return None
        with pytest.raises(dist.CommError, match=r"recv_array: rank 1 timed out after 0.3 s "
                                                 r"waiting for rank 0 \(tag 4, header receive"):
            dist.recv_array(0, tag=4, timeout=0.3)
        got = dist.recv_array(0, tag=3).tolist()
        dist.barrier()
        return got

    assert dist.spawn_threads(job, 2)[1] == [0.0, 0.0]


def test_a_message_of_the_other_kind_is_refused_and_the_stream_stays_in_step():
    def send():
        dist.send_object({"a": 1}, 1)
        dist.send_array(np.arange(3, dtype=np.float32), 1)
        dist.send_object("x", 1)
        dist.send_object("next", 1)

    def recv():
        errors = []
        for call in (lambda: dist.recv_array(0), lambda: dist.recv_object(0),
                     lambda: dist.recv(np.zeros(3, np.float32), 0)):
            with pytest.raises(dist.MessageError if len(errors) < 2 else dist.CommError) as e:
                call()
            errors.append(str(e.value))
        return errors, dist.recv_object(0)

    (array_err, object_err, recv_err), after = _pair(send, recv)
    size = _wire.encode_object({"a": 1}, "t").size
    assert f"recv_array: rank 1 expected an array message from rank 0 (tag 0), got an object " \
           f"of {size} bytes" in array_err
    assert "recv_object: rank 1 expected an object message from rank 0 (tag 0), got an array " \
           "float32 (3,)" in object_err
    assert "expected float32 (3,), got an object of 3 bytes" in recv_err
    assert after == "next"


def test_a_payload_over_max_bytes_is_refused_before_allocating():
    def send():
        dist.send_array(np.zeros(100, np.float32), 1)
        dist.send_object("y" * 1000, 1)

    def recv():
        out = []
        for call in (lambda: dist.recv_array(0, max_bytes=399),
                     lambda: dist.recv_object(0, max_bytes=500)):
            with pytest.raises(dist.MessageError) as e:
                call()
            out.append(str(e.value))
        return out

    array_err, object_err = _pair(send, recv)
    assert "recv_array: the header from rank 0 (tag 0) announces a payload of 400 bytes " \
           "(float32 (100,)), expected at most 399 bytes" in array_err
    assert "announces a payload of 1002 bytes (an object of 1002 bytes), expected at most " \
           "500 bytes" in object_err


def _forge(header: bytes, payload: bytes | None = None, tag: int = 0):
    """Rank 0's sender: raw transport messages on the tags of user tag ``tag``."""
    def send():
        pg = resolve(None, "forge")
        raw = np.frombuffer(header, np.uint8).copy()
        pg.p2p.isend(raw, 1, 2 * tag).wait(pg.deadline())
        if payload is not None:
            pg.p2p.isend(np.frombuffer(payload, np.uint8).copy(), 1, 2 * tag + 1).wait(
                pg.deadline())

    return send


def _header(magic=b"NDL2", kind=0, code=0, ndim=1, dims=(4,)) -> bytes:
    dims = list(dims) + [0] * (_wire.MAX_NDIM - len(dims))
    return _wire._HEADER.pack(magic, kind, code, ndim, *dims)


@pytest.mark.parametrize("header", [
    _header(magic=b"EVIL"), _header(kind=9), _header(code=200), _header(ndim=9),
    _header(dims=(-4,)), _header(kind=_wire.OBJECT, code=0),  # an object must be uint8 1-D
])
def test_forged_headers_are_refused(header):
    def recv():
        with pytest.raises(dist.MessageError, match="recv_array: received a malformed message "
                                                    "header"):
            dist.recv_array(0)
        return True

    assert _pair(_forge(header), recv)


def test_a_forged_header_announcing_exabytes_is_refused():
    huge = _header(code=_wire.DTYPES.index("float64"), ndim=2, dims=(2**31, 2**31))

    def recv():
        with pytest.raises(dist.MessageError, match=r"announces a payload of 36893488147419103232 "
                                                    r"bytes \(float64 \(2147483648, 2147483648\)"):
            dist.recv_array(0)
        return True

    assert _pair(_forge(huge), recv)


@pytest.mark.parametrize("payload,why", [
    (b"not json", "JSONDecodeError"), (b"\xff\xfe", "UnicodeDecodeError"),
    (b'{"eval":"print(1)"}', "the tag 'eval'"), (b'{"a":1,"b":2}', "a JSON object with keys"),
    (b"NaN", "the JSON constant NaN"), (b'{"float":"1e3"}', "the tag 'float'"),
    (b'{"bytes":"**"}', "bytes that are not base64"), (b'{"dict":[[1.5,2]]}', "a dict item"),
    (b"[" * 100 + b"]" * 100, "nesting deeper than 64"),
])
def test_forged_object_encodings_are_refused(payload, why):
    header = _header(kind=_wire.OBJECT, code=_wire.DTYPES.index("uint8"), dims=(len(payload),))

    def recv():
        with pytest.raises(dist.MessageError, match="recv_object: the object message does not "
                                                    "decode, expected needle's object encoding"):
            try:
                dist.recv_object(0)
            except dist.MessageError as exc:
                assert why in str(exc), exc
                raise
        return True

    assert _pair(_forge(header, payload), recv)


def test_an_abort_raises_sender_aborted_with_the_reason_in_every_receive():
    def send():
        for tag in (1, 2, 3):
            p2p.isend_abort(f"stage {tag} failed", 1, tag=tag).wait()

    def recv():
        out = []
        for call in (lambda: dist.recv_array(0, tag=1), lambda: dist.recv_object(0, tag=2),
                     lambda: dist.recv(np.zeros(4, np.uint8), 0, tag=3)):
            with pytest.raises(dist.SenderAborted) as e:
                call()
            out.append((e.value.reason, str(e.value)))
        return out

    got = _pair(send, recv)
    assert [r for r, _ in got] == ["stage 1 failed", "stage 2 failed", "stage 3 failed"]
    assert "rank 0 aborted instead of sending to rank 1 (tag 2): stage 2 failed" in got[1][1]


def test_object_collectives_refuse_objects_over_max_bytes():
    def job(rank):
        with pytest.raises(dist.MessageError, match=r"all_gather_object: the ranks' objects take "
                                                    r"44 bytes \(\[2, 42\]\), expected at most 43 "
                                                    r"bytes"):
            dist.all_gather_object("z" * (40 * rank), max_bytes=43)
        with pytest.raises(dist.MessageError, match=r"gather_object: 2 objects padded to the "
                                                    r"largest \(42 bytes\) take 84 bytes"):
            dist.gather_object("z" * (40 * rank), max_bytes=60)
        return True

    assert dist.spawn_threads(job, 2) == [True, True]


# ---- the parameter server's requests -------------------------------------------------------
def test_parameter_server_requests_are_checked_field_by_field():
    from needle.distributed.ps import wire

    good = wire.request(wire.PUSH, clock=2, examples=4, loss_sum=1.0, shard_key=7)
    assert wire.parse_request(good, 3) == good
    bad = [({**good, "op": "delete"}, "unknown op"), ({**good, "clock": "2"}, "clock of type int"),
           ({**good, "extra": 1}, "expected the fields"), ([1, 2], "got list"),
           ({**good, "examples": True}, "examples of type int")]
    for obj, why in bad:
        with pytest.raises(dist.MessageError, match=f"worker rank 3 sent .*{why}"):
            wire.parse_request(obj, 3)


def test_only_a_finish_carries_a_report_of_named_integers():
    from needle.distributed.ps import wire

    row = {"rank": 2, "peak": {"predicted": 10, "measured": 10, "step": None}}
    done = wire.request(wire.FINISH, clock=5, report=row)
    assert wire.parse_request(done, 2)["report"] == row
    push = {**wire.request(wire.PUSH, clock=5), "report": row}
    with pytest.raises(dist.MessageError, match="expected the fields"):
        wire.parse_request(push, 2)  # a report rides on a FINISH only
    bad = [({"peak": {"predicted": 1.5}}, "section 'peak'"), ({"rank": "2"}, "'rank' = '2'"),
           ({f"k{i}": 1 for i in range(9)}, "of 9"), ({"peak": {"x": [1] * 3}}, "section"),
           ([1], "got list")]
    for report, why in bad:
        with pytest.raises(dist.MessageError, match=f"rank 2 sent a malformed report.*{why}"):
            wire.parse_request({**done, "report": report}, 2)


# ---- host staging --------------------------------------------------------------------------
def test_to_host_copies_and_keeps_shape():
    import needle as ndl

    src = np.arange(6.0).reshape(2, 3)
    out = _buffers.to_host(src)
    src[0, 0] = 99
    assert out[0, 0] == 0 and out.flags.c_contiguous and out.flags.writeable
    assert _buffers.to_host(np.float32(2)).shape == ()
    assert _buffers.to_host(ndl.Tensor(np.ones((2, 2), np.float32)), flat=True).shape == (4,)
    t = ndl.Tensor(np.array(3.0, np.float32))
    assert _buffers.to_host(t).shape == () and _buffers.to_host(t.realize_cached_data()) == 3.0
    assert _buffers.to_host(src.T).flags.c_contiguous


def test_to_device_takes_device_and_dtype_from_like():
    import needle as ndl

    like = ndl.Tensor(np.zeros(2, np.float32), device=ndl.cpu_numpy())
    out = _buffers.to_device(np.arange(6, dtype=np.float64)[::2], like=like, shape=(3, 1))
    assert (out.shape, out.dtype, out.device) == ((3, 1), "float32", ndl.cpu_numpy())
    assert out.numpy().ravel().tolist() == [0.0, 2.0, 4.0]
    zero_d = _buffers.to_device(np.array(5.0, np.float32), ndl.cpu())
    assert zero_d.shape == () and zero_d.device == ndl.cpu()


@pytest.mark.slow
def test_cuda_tensors_travel_as_arrays_and_come_back_on_the_device(emulated_cuda):
    dev = emulated_cuda

    def job(rank):
        if rank == 0:
            dist.send_array(Tensor(np.array([[1.0, 2.0]], np.float32), device=dev), 1)
            return None
        host = dist.recv_array(0)
        back = _buffers.to_device(host, dev)
        return host.tolist(), back.device == dev, _buffers.to_host(back).tolist()

    assert dist.spawn_threads(job, 2)[1] == ([[1.0, 2.0]], True, [[1.0, 2.0]])
