"""The cuDNN plan cache (`backend/cuda/plan_cache.py`, `CudnnGraphs` with a store), against the recording fake of
`import cudnn` (tests/backend/test_cuda_host.py) extended with the frontend's plan records: `(engine_id, knobs)`,
`serialize`/`deserialize`, `create_execution_plan`, and `execute` of a deserialized graph (signatures as in
nvidia-cudnn-frontend 1.32's python/cudnn/_pygraph.py).

A second process (a new fake and a new CudnnGraphs on the same folder) must get the same plans, indices, names and
workspaces without the heuristics query or any plan build, and run each plan with its own pointers; every way
an entry can fail to load ends in a fresh build, never in an error."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from minidl.backend.cuda import cudnn_specs
from minidl.backend.cuda.cudnn_graphs import CudnnGraphs
from minidl.backend.cuda.plan_cache import PlanEnv, PlanStore
from minidl.core import startup

from .test_cuda_host import FakeCudnn, FakeGraph, _Enum, _op_of

ENV = PlanEnv("NVIDIA H100 80GB HBM3", "90", "91900", "1.32.0")
TABLES = {"conv_fprop": [(4096, "f0", True), (0, "f1", False), (512, "f2", True), (0, "f3", True)],
          "conv_dgrad": [(256, "d0", True)], "conv_wgrad": [(1024, "w0", True), (0, "w1", True)],
          "batchnorm": [(64, "bn0", True), (0, "bn1", True), (0, "bn2", True)],
          "batchnorm_backward": [(0, "bb0", True)], "relu": [(0, "r0", True), (0, "r1", True)],
          "relu_backward": [(0, "rb0", True)]}


@dataclass(frozen=True)
class Knob:
    """A `cudnn.knob_type` member as the frontend hands it out (the cache records its name)."""

    name: str


class CachingGraph(FakeGraph):
    """FakeGraph with the plan records of the real frontend: the engine of table row i is 100 + i, with one knob;
    a serialized plan is a blob naming its op and row; a deserialized graph has one plan and is run by `execute`."""

    def __init__(self, fake, **kw):
        super().__init__(fake, **kw)
        self.selected = None
        self.appended: list[int] = []     # table rows of the plans create_execution_plan appended
        self.loaded = None                # (op, row) of a deserialized plan

    def _table(self):
        rows = self.fake.plan_table(self)
        return rows + [rows[r] for r in self.appended]

    def _row(self, index):
        n = len(self.fake.plan_table(self))
        return index if index < n else self.appended[index - n]

    def get_execution_plan_count(self):
        return len(self._table())

    def build_plan_at_index(self, index):
        super().build_plan_at_index(index)
        self.fake.builds.append((_op_of(self), self._row(index)))
        self.selected = index

    def get_engine_and_knobs_at_index(self, index):
        return 100 + self._row(index), {Knob("TILE"): 7}

    def serialize(self, *, as_bytes=False, include_kernels=True):
        if self.fake.refuse_serialize:
            raise RuntimeError("cudnnGraphNotSupportedError: this engine does not serialize")
        blob = json.dumps({"op": _op_of(self), "row": self._row(self.selected)}).encode()
        return blob if as_bytes else list(blob)

    def deserialize(self, handle, data):
        if self.fake.refuse_deserialize:
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM: the serialized plan is for another cuDNN")
        d = json.loads(bytes(data))
        self.loaded = (d["op"], d["row"])
        self.fake.deserialized.append(self.loaded)

    def get_workspace_size(self):
        op, row = self.loaded
        return self.fake.tables[op][row][0] + self.fake.workspace_drift

    def create_execution_plan(self, engine_id, knobs=None):
        assert knobs == {"knob_type.TILE": 7}, knobs   # the knob as the frontend named it
        self.calls.append(("create_execution_plan", {"engine_id": engine_id}))
        self.appended.append(engine_id - 100)

    def get_workspace_size_plan_at_index(self, index):
        ws = super().get_workspace_size_plan_at_index(index)
        return ws + self.fake.workspace_drift if index >= len(self.fake.plan_table(self)) else ws

    def execute(self, tensor_dict, workspace=None, handle=None):
        assert all(type(k) is int for k in tensor_dict), "a deserialized graph is fed by uid"
        self.fake.executions.append(("execute", self.loaded, dict(tensor_dict), workspace, handle))

    def execute_plan_at_index(self, tensor_dict, workspace, index, handle=None):
        self.fake.executions.append(("at_index", (_op_of(self), self._row(index)), dict(tensor_dict), workspace,
                                     handle))


class CachingCudnn(FakeCudnn):
    knob_type = _Enum("knob_type")

    def __init__(self, tables=TABLES, refuse_serialize=False, refuse_deserialize=False, workspace_drift=0):
        super().__init__(plans=lambda g: tables[_op_of(g)])
        self.tables = tables
        self.builds, self.deserialized = [], []
        self.refuse_serialize, self.refuse_deserialize = refuse_serialize, refuse_deserialize
        self.workspace_drift = workspace_drift

    def pygraph(self, **kw):
        g = CachingGraph(self, **kw)
        self.graphs.append(g)
        return g

    def heuristics_queries(self):
        return sum(1 for g in self.graphs for op, _ in g.calls if op == "create_execution_plans")


def _key(op="fprop", allow_tf32=False):
    spec = cudnn_specs.ConvSpec.from_shapes((2, 4, 9, 7), (6, 2, 3, 2), (2, 6, 5, 7), (2, 1), (1, 1), (1, 2), 2,
                                            np.float32)
    return spec.key(op, cudnn_specs.EngineFilters(allow_tf32=allow_tf32))


def _graphs(fake, folder, env=ENV):
    return CudnnGraphs(fake, handle=7, max_plans=8, store=PlanStore(folder, env))


def test_a_second_process_loads_the_plans_without_building_any(tmp_path):
    cold_fake = CachingCudnn()
    cold = _graphs(cold_fake, tmp_path).get(_key())
    assert [(p.index, p.name, p.workspace_bytes) for p in cold.plans] == [(0, "f0", 4096), (2, "f2", 512),
                                                                            (3, "f3", 0)]
    assert cold_fake.heuristics_queries() == 1 and len(cold_fake.builds) == 3
    (entry,) = (tmp_path / ENV.folder_name()).glob("*.json")

    fake = CachingCudnn()
    graphs = _graphs(fake, tmp_path)
    warm = graphs.get(_key())
    assert warm.plans == cold.plans and warm.relaxed == cold.relaxed
    assert fake.heuristics_queries() == 0 and fake.builds == []
    assert fake.deserialized == [("conv_fprop", 0), ("conv_fprop", 2), ("conv_fprop", 3)]
    assert graphs.stats == {"built": 0, "loaded": 1, "replayed": 0, "stale": 0}
    # each plan runs on its own deserialized graph, the pack keyed by the uids the cold graph gave its tensors
    graphs.execute(warm, {"x": 0x1000, "w": 0x2000, "y": 0x3000}, 0x4000, 2)
    (kind, plan, pack, workspace, handle), = fake.executions
    uids = {name: t.get_uid() for name, t in cold.tensors.items()}
    assert (kind, plan, workspace, handle) == ("execute", ("conv_fprop", 2), 0x4000, 7)
    assert pack == {uids["x"]: 0x1000, uids["w"]: 0x2000, uids["y"]: 0x3000}
    with pytest.raises(ValueError, match="missing"):
        graphs.execute(warm, {"x": 1, "w": 2}, 0, 0)
    assert entry.exists()


def test_plans_that_do_not_deserialize_are_rebuilt_from_their_engine_and_knobs(tmp_path):
    _graphs(CachingCudnn(), tmp_path).get(_key())
    fake = CachingCudnn(refuse_deserialize=True)
    graphs = _graphs(fake, tmp_path)
    warm = graphs.get(_key())
    assert [(p.index, p.name, p.workspace_bytes) for p in warm.plans] == [(0, "f0", 4096), (2, "f2", 512),
                                                                            (3, "f3", 0)]
    assert fake.heuristics_queries() == 0
    assert fake.builds == [("conv_fprop", 0), ("conv_fprop", 2), ("conv_fprop", 3)]   # those three, nothing else
    assert graphs.stats["replayed"] == 1 and "not deserialized" in graphs.cache_notes[0]
    graphs.execute(warm, {"x": 1, "w": 2, "y": 3}, 0, 3)
    (kind, plan, pack, _, _), = fake.executions
    assert (kind, plan) == ("at_index", ("conv_fprop", 3)) and pack == {warm.tensors["x"]: 1, warm.tensors["w"]: 2,
                                                                         warm.tensors["y"]: 3}


def test_plans_that_do_not_serialize_are_rebuilt_from_their_engine_and_knobs(tmp_path):
    _graphs(CachingCudnn(refuse_serialize=True), tmp_path).get(_key("wgrad"))
    fake = CachingCudnn()
    graphs = _graphs(fake, tmp_path)
    assert [p.name for p in graphs.get(_key("wgrad")).plans] == ["w0", "w1"]
    assert fake.deserialized == [] and fake.heuristics_queries() == 0 and len(fake.builds) == 2
    assert graphs.stats["replayed"] == 1


def test_an_entry_that_no_longer_builds_the_same_is_built_afresh_and_rewritten(tmp_path):
    _graphs(CachingCudnn(), tmp_path).get(_key())
    drifted = CachingCudnn(refuse_deserialize=True, workspace_drift=256)   # another library build, say
    graphs = _graphs(drifted, tmp_path)
    built = graphs.get(_key())
    assert graphs.stats == {"built": 1, "loaded": 0, "replayed": 0, "stale": 1}
    assert "workspace of 4352 bytes, recorded 4096" in graphs.cache_notes[-1]
    assert drifted.heuristics_queries() == 1 and [p.workspace_bytes for p in built.plans] == [4096, 512, 0]
    again = CachingCudnn()
    g3 = _graphs(again, tmp_path)
    g3.get(_key())
    assert g3.stats["loaded"] == 1 and again.builds == []


def test_unreadable_or_foreign_entries_are_misses(tmp_path):
    store = PlanStore(tmp_path, ENV)
    _graphs(CachingCudnn(), tmp_path).get(_key())
    path = store.path(_key(), 8)
    path.write_text("{not json")
    fake = CachingCudnn()
    graphs = _graphs(fake, tmp_path)
    graphs.get(_key())
    assert graphs.stats["built"] == 1 and fake.heuristics_queries() == 1      # rebuilt, and the entry rewritten
    assert store.load(_key(), 8) is not None
    data = json.loads(path.read_text())
    data["key"] = data["key"].replace("conv_fprop", "conv_dgrad")             # a file under another key's name
    path.write_text(json.dumps(data))
    assert store.load(_key(), 8) is None


@pytest.mark.parametrize("other", ["math", "device", "cudnn", "max_plans"])
def test_the_key_holds_device_libraries_math_mode_and_plan_limit(tmp_path, other):
    _graphs(CachingCudnn(), tmp_path).get(_key())
    fake = CachingCudnn()
    env = {"device": PlanEnv("NVIDIA H200", "90", "91900", "1.32.0"),
           "cudnn": PlanEnv(ENV.device, "90", "91000", "1.32.0")}.get(other, ENV)
    graphs = CudnnGraphs(fake, handle=7, max_plans=2 if other == "max_plans" else 8, store=PlanStore(tmp_path, env))
    graphs.get(_key(allow_tf32=other == "math"))
    assert graphs.stats["built"] == 1 and fake.heuristics_queries() == 1


def test_batch_norm_and_relu_graphs_build_one_plan_only(tmp_path):
    fake = CachingCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    f = cudnn_specs.EngineFilters()
    bn = graphs.get(cudnn_specs.BNSpec.from_shape((4, 6, 5, 3), np.float32).key("bn_train", f))
    relu = graphs.get(cudnn_specs.PointwiseSpec.from_shape((4, 6), np.float32).key("relu_fwd", f))
    assert [p.name for p in bn.plans] == ["bn0"] and [p.name for p in relu.plans] == ["r0"]
    assert fake.builds == [("batchnorm", 0), ("relu", 0)]
    conv = graphs.get(_key())
    assert len(conv.plans) == 3 and graphs.plan_limit(_key()) == 8


def test_graph_builds_are_timed_as_a_startup_phase(tmp_path):
    ticks = iter(range(100))
    clock = startup.StartupClock(clock=lambda: float(next(ticks)))
    saved, startup.CLOCK = startup.CLOCK, clock
    try:
        clock.begin(origin=0.0)
        with clock.phase("planning"):
            _graphs(CachingCudnn(), tmp_path).get(_key())
        clock.first_step_done()
    finally:
        startup.CLOCK = saved
    parts = clock.report().parts
    assert parts["cudnn_graphs"] == 1.0 and parts["planning"] == 2.0


def test_autotune_without_a_file_keeps_a_gpus_measurements_beside_its_plans_per_math_mode(tmp_path):
    from types import SimpleNamespace

    from minidl.backend.cpu.backend import CPUBackend
    from minidl.cli.common import cost_table

    from .test_cuda_host import _host_backend

    be = _host_backend(CachingCudnn())
    be.graphs = _graphs(CachingCudnn(), tmp_path)
    bare = SimpleNamespace(autotune="")
    assert cost_table(bare, be).path == str(tmp_path / ENV.folder_name() / "autotune-fp32.json")
    be.set_math("tf32")
    assert cost_table(bare, be).path == str(tmp_path / ENV.folder_name() / "autotune-tf32.json")
    assert cost_table(SimpleNamespace(autotune="mine.json"), be).path == "mine.json"
    assert cost_table(bare, CPUBackend()).path is None
    be.graphs = CudnnGraphs(CachingCudnn(), handle=1)   # no plan cache: nothing kept either
    assert cost_table(bare, be).path is None
