"""The NCCL communicator on the host, against recording fakes of cupy's `cuda.nccl` bindings, events and streams
(no GPU, cupy or NCCL needed); and the reducer's ordered sum with a fake 2-rank communicator. The NCCL path has
not run on a GPU: these tests hold its calls to the bindings' signatures
(`NcclCommunicator(ndev, commId, rank)`, `allGather(sendbuf, recvbuf, count, datatype, stream)`)."""
from types import SimpleNamespace

import numpy as np
import pytest

from minidl.backend.cpu.backend import CPUBackend
from minidl.core.errors import DistError
from minidl.dist.comm import Communicator, Request
from minidl.dist.nccl import NCCLComm
from minidl.dist.reducer import GradientReducer


class Log(list):
    def __call__(self, *entry):
        self.append(entry)


class FakeEvent:
    def __init__(self, log, **kw):
        self.log, self.done, self.kw = log, False, kw

    def record(self, stream):
        self.log("record", self, stream.name)


class FakeStream:
    def __init__(self, log, name, ptr):
        self.log, self.name, self.ptr = log, name, ptr

    def wait_event(self, ev):
        self.log("wait_event", self.name, ev)

    def synchronize(self):
        self.log("synchronize", self.name)


class FakeNcclComm:
    def __init__(self, log, ndev, uid, rank):
        self.log = log
        log("init", ndev, uid, rank)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802 - cupy's name
        self.log("allGather", sendbuf, recvbuf, count, datatype, stream)

    def abort(self):
        self.log("abort")

    def destroy(self):
        self.log("destroy")


class FakeMPI(Communicator):
    kind = "mpi"

    def __init__(self, rank, size, log):
        super().__init__(rank, size, timeout_s=0.05)
        self.log = log

    def bcast(self, obj):
        self.log("bcast", obj)
        return ("uid-of-rank-0",)

    def check_peers(self):
        self.log("check_peers")


def make(rank=1, size=2):
    log = Log()
    nccl = SimpleNamespace(get_unique_id=lambda: ("uid-of-rank-0",), NCCL_FLOAT32=7, NCCL_FLOAT64=8,
                           NCCL_FLOAT16=6, NcclCommunicator=lambda n, uid, r: FakeNcclComm(log, n, uid, r))
    streams = iter([FakeStream(log, "comm", 0xC0)])
    cp = SimpleNamespace(cuda=SimpleNamespace(Event=lambda **kw: FakeEvent(log, **kw),
                                              Stream=lambda non_blocking: next(streams)))
    be = SimpleNamespace(compute=FakeStream(log, "compute", 0xA0))
    comm = NCCLComm(FakeMPI(rank, size, log), be, nccl=nccl, cupy=cp)
    return comm, log


def device_buffer(shape, dtype=np.float32, ptr=0x10000, contiguous=True):
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype), data=SimpleNamespace(ptr=ptr),
                           flags=SimpleNamespace(c_contiguous=contiguous))


def test_setup_carries_rank0s_unique_id_over_mpi():
    comm, log = make(rank=1, size=2)
    assert ("bcast", None) in log  # rank 1 sends nothing, receives rank 0's id
    assert ("init", 2, ("uid-of-rank-0",), 1) in log
    assert comm.kind == "nccl" and (comm.rank, comm.size) == (1, 2)


def test_allgather_is_in_place_on_its_own_stream_after_compute():
    comm, log = make(rank=1, size=2)
    log.clear()
    req = comm.start_allgather(device_buffer((2, 1000)))
    kinds = [e[0] for e in log]
    assert kinds == ["record", "wait_event", "allGather", "record"]
    ready, done = log[0][1], log[3][1]
    assert log[0][2] == "compute" and log[1] == ("wait_event", "comm", ready)  # reads the packed row
    assert log[2] == ("allGather", 0x10000 + 1 * 1000 * 4, 0x10000, 1000, 7, 0xC0)  # send = recv + rank*count
    assert log[3][2] == "comm" and req.handle is done
    assert not comm.test(req)
    done.done = True
    log.clear()
    comm.wait(req, "the all-reduce of bucket:0")
    assert ("wait_event", "compute", done) in log  # the ordered sum on compute reads the gathered rows


def test_wait_times_out_naming_the_rank_and_aborts_nccl():
    comm, log = make(rank=0, size=2)
    req = comm.start_allgather(device_buffer((2, 8), np.float64))
    assert log[-2][4] == 8  # NCCL_FLOAT64
    with pytest.raises(DistError, match=r"rank 0 of 2: the all-reduce of bucket:3 \(NCCL\) did not complete"):
        comm.wait(req, "the all-reduce of bucket:3")
    assert ("abort",) in log


@pytest.mark.parametrize("buf", [device_buffer((2, 4), np.int32), device_buffer((3, 4)),
                                 device_buffer((2, 4), contiguous=False)])
def test_bad_buffers_are_refused(buf):
    comm, _ = make()
    with pytest.raises(DistError, match="NCCL all-gather needs"):
        comm.start_allgather(buf)


class TwoRanks(Communicator):
    """Rank `rank` of 2 whose all-gather writes a known row for the other rank."""

    def __init__(self, rank, other_row):
        super().__init__(rank, 2)
        self.other_row = other_row

    def start_allgather(self, buf, second=False):
        buf[1 - self.rank] = self.other_row
        return Request(done=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_reducer_sums_rows_in_rank_order_then_divides(rank):
    rng = np.random.default_rng(0)
    g = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    other = rng.standard_normal(17).astype(np.float32)
    mine = np.concatenate([a.ravel() for a in g])
    red = GradientReducer(TwoRanks(rank, other), CPUBackend())
    buf = np.zeros((2, 17), np.float32)
    red.start("bucket:0", buf, g, 5)
    red.progress()
    red.finish("bucket:0", buf, g, 9)
    rows = [mine, other] if rank == 0 else [other, mine]
    want = (rows[0] + rows[1]) / np.float32(2)  # row 0 first, on both ranks: the same bits everywhere
    got = np.concatenate([a.ravel() for a in g])
    assert np.array_equal(got, want)
    red.end_iteration()
    assert red.stats.buckets == 1 and red.stats.bytes_per_step == 17 * 4


class Ranks(Communicator):
    """Rank `rank` of N whose collectives deliver what the other ranks (whose packed rows are `rows`) would send,
    with their sums made in rank order as their reducers make them."""

    def __init__(self, rank, rows):
        super().__init__(rank, len(rows))
        self.rows = rows

    def start_alltoall(self, send, recv):
        n = self.size
        chunks = recv.reshape(n, -1)
        for j in range(n):
            chunks[j] = (send if j == self.rank else self.rows[j]).reshape(n, -1)[self.rank]
        return Request(done=True)

    def start_allgather(self, buf, second=False):
        n = self.size
        if buf.shape[0] == n and buf.shape[1] == len(self.rows[0]):  # gather: whole rows
            for j in range(n):
                if j != self.rank:
                    buf[j] = self.rows[j]
        else:  # ring's second half: the other ranks' reduced chunks
            for j in range(n):
                if j != self.rank:
                    acc = self.rows[0].reshape(n, -1)[j].copy()
                    for r in range(1, n):
                        acc += self.rows[r].reshape(n, -1)[j]
                    buf[j] = acc
        return Request(done=True)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ring_and_gather_reductions_give_the_same_bits_on_every_rank(rank):
    from minidl.memory.decisions.allreduce import bucket_shape

    n = 3
    shapes = [(3, 4), (5,)]  # 17 elements: ring pads to 18
    grads_of = [[np.random.default_rng(10 + r).standard_normal(sh).astype(np.float32) for sh in shapes]
                for r in range(n)]
    results = {}
    for reduction in ("ring", "gather"):
        rows_shape = bucket_shape(reduction, n, 17)
        width = rows_shape[1]
        rows = [np.concatenate([g.ravel() for g in grads_of[r]] + [np.zeros(width - 17, np.float32)])
                for r in range(n)]
        g = [a.copy() for a in grads_of[rank]]
        red = GradientReducer(Ranks(rank, rows), CPUBackend(), reduction=reduction)
        buf = np.full(rows_shape, np.nan, np.float32)  # padding and received parts must all be written
        red.start("bucket:0", buf, g, 5)
        red.progress()
        red.progress()
        red.finish("bucket:0", buf, g, 9)
        results[reduction] = np.concatenate([a.ravel() for a in g])
    flat = [np.concatenate([a.ravel() for a in grads_of[r]]) for r in range(n)]
    want = ((flat[0] + flat[1]) + flat[2]) / np.float32(n)  # rank order, then / N
    assert np.array_equal(results["ring"], results["gather"])
    assert np.array_equal(results["ring"], want)


class ManyBuckets(Communicator):
    """Rank `rank` of N with several buckets in flight: each collective answers with the rows of the bucket whose
    buffer it was given (`Ranks` for one bucket)."""

    def __init__(self, rank, n):
        super().__init__(rank, n)
        self.buckets: list[tuple[np.ndarray, Ranks]] = []

    def _of(self, a) -> Ranks:
        return next(r for buf, r in self.buckets if np.shares_memory(buf, a))

    def start_alltoall(self, send, recv):
        return self._of(send).start_alltoall(send, recv)

    def start_allgather(self, buf, second=False):
        return self._of(buf).start_allgather(buf, second)


@pytest.mark.parametrize("reduction", ["gather", "ring"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_every_bucket_sums_in_rank_order_on_three_ranks(rank, reduction):
    """Exact bits of every bucket, odd and even, in two steps (all in flight at once, then one after the other),
    on a fake 3-rank communicator: the sum is
    ((g_0 + g_1) + g_2) / 3 everywhere (with two ranks any order gives the same bits, so three are needed; the
    MPI test that runs three real ranks is marked slow). The data is chosen so that another order would differ."""
    from minidl.memory.decisions.allreduce import bucket_shape

    n = 3
    comm = ManyBuckets(rank, n)
    red = GradientReducer(comm, CPUBackend(), reduction=reduction)
    sizes = [[(3, 4), (5,)], [(7,)], [(2, 2), (4,), (3,)], [(11,)], [(6,)]]
    for it in range(2):
        comm.buckets.clear()
        started = []
        for b, shapes in enumerate(sizes):
            total = sum(int(np.prod(sh)) for sh in shapes)
            shape = bucket_shape(reduction, n, total)
            flat = [(np.random.default_rng(100 * it + 10 * b + r).standard_normal(total) * 10.0 ** (r - 1))
                    .astype(np.float32) for r in range(n)]
            for i in range(0, total, shape[1] // n if reduction == "ring" else total):  # one per ring chunk
                for r, v in enumerate((1.0, 2.0 ** -24, -1.0)):   # (g0 + g1) + g2 = 0; any other order 2^-24
                    flat[r][i] = v
            cuts = np.cumsum([int(np.prod(sh)) for sh in shapes])[:-1]
            grads_of = [[a.reshape(sh) for a, sh in zip(np.split(f, cuts), shapes)] for f in flat]
            rows = [np.concatenate([f, np.zeros(shape[1] - total, np.float32)]) for f in flat]
            buf = np.full(shape, np.nan, np.float32)
            comm.buckets.append((buf, Ranks(rank, rows)))
            g = [a.copy() for a in grads_of[rank]]
            red.start(f"bucket:{b}", buf, g, b)
            red.progress()
            want = ((flat[0] + flat[1]) + flat[2]) / np.float32(n)
            for other in (((flat[0] + flat[2]) + flat[1]), ((flat[2] + flat[1]) + flat[0])):
                assert not np.array_equal(want, other / np.float32(n))
            started.append((b, buf, g, want))
            if it == 1:   # step 0: every bucket in flight at once; step 1: each reduced before the next starts
                red.finish(f"bucket:{b}", buf, g, 9)
                assert np.array_equal(np.concatenate([a.ravel() for a in g]), want), (it, b)
        for b, buf, g, want in started if it == 0 else ():
            red.finish(f"bucket:{b}", buf, g, 9)
            assert np.array_equal(np.concatenate([a.ravel() for a in g]), want), (it, b)
        red.end_iteration()
    assert red.stats.buckets == 2 * len(sizes)
