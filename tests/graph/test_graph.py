"""Build-time errors name the layer, its type and the shapes; the route follows the declarations."""
import pytest

import minidl as dl
from minidl import layers as L
from minidl.graph.route import Phase


def small_net(batch=4):
    net = dl.Network("small")
    x = net.input((batch, 12))
    y = net.input((batch,), dtype="int64", name="label")
    h = L.ReLU(name="r1")(L.Linear(8, name="fc1")(x))
    a = L.Linear(8, name="fc2")(h)
    s = L.Add(name="sum")(a, h)
    logits = L.Linear(3, name="fc3")(s)
    net.set_loss(L.SoftmaxCrossEntropy(name="loss")(logits, y))
    return net


def test_shape_mismatch_names_layer_and_shapes():
    net = dl.Network()
    x = net.input((2, 3, 8, 8))
    z = net.input((2, 4, 8, 8), name="other")
    with pytest.raises(dl.GraphError) as e:
        L.Add(name="join")(x, z)
    msg = str(e.value)
    assert "join" in msg and "add" in msg and "(2, 3, 8, 8)" in msg and "(2, 4, 8, 8)" in msg


def test_duplicate_names_and_reused_layers():
    net = dl.Network()
    x = net.input((2, 5))
    L.Linear(3, name="fc")(x)
    with pytest.raises(dl.GraphError, match="duplicate name 'fc'"):
        L.Linear(3, name="fc")(x)
    relu = L.ReLU()
    relu(x)
    with pytest.raises(dl.GraphError, match="already called"):
        relu(x)


def test_dangling_input_and_unused_branch():
    net = dl.Network()
    x = net.input((2, 5))
    net.input((2, 5), name="unused_input")
    y = net.input((2,), dtype="int64", name="label")
    net.set_loss(L.SoftmaxCrossEntropy()(L.Linear(3)(x), y))
    with pytest.raises(dl.GraphError, match="dangling"):
        net.route()
    net = dl.Network()
    x = net.input((2, 5))
    y = net.input((2,), dtype="int64", name="label")
    L.ReLU(name="dead_end")(x)
    net.set_loss(L.SoftmaxCrossEntropy()(L.Linear(3)(x), y))
    with pytest.raises(dl.GraphError, match="dead_end.*unused branch"):
        net.route()


def test_loss_checks():
    net = dl.Network()
    x = net.input((2, 5))
    y = net.input((3,), dtype="int64", name="label")
    with pytest.raises(dl.GraphError, match="labels must be"):
        L.SoftmaxCrossEntropy()(x, y)
    yf = net.input((2,), name="float_label")
    with pytest.raises(dl.GraphError, match="integers"):
        L.SoftmaxCrossEntropy()(x, yf)
    with pytest.raises(dl.GraphError, match="no loss"):
        net.route()
    with pytest.raises(dl.GraphError, match="not a loss"):
        net.set_loss(L.ReLU()(x))


def test_route_structure_and_fork_accumulation():
    net = small_net()
    route = net.route(optimizer_slots=("momentum",))
    phases = [s.phase for s in route.steps]
    n_layers = len(net.layer_nodes)
    assert phases[:n_layers] == [Phase.FORWARD] * n_layers
    assert phases[-1] is Phase.UPDATE
    bwd = [s.name for s in route.steps if s.phase is Phase.BACKWARD]
    assert bwd == ["loss", "fc3", "sum", "fc2", "r1", "fc1"]
    # r1 feeds fc2 and sum: sum's backward writes the delta, fc2's writes a partial that is accumulated.
    fc2 = next(s for s in route.steps if s.phase is Phase.BACKWARD and s.name == "fc2")
    assert [(a.partial, a.into) for a in fc2.accumulate] == [("dpart:r1@fc2.0", "delta:r1")]
    # ReLU's backward reads its output, not its input; Linear's reads its input.
    r1 = next(s for s in route.steps if s.phase is Phase.BACKWARD and s.name == "r1")
    assert "act:r1" in r1.reads and "act:fc1" not in r1.reads
    assert "opt:fc1.weight.momentum" in route.tensors
    assert route.tensors["act:label"].role is dl.Role.LABEL


def test_num_params_and_flops():
    net = small_net()
    assert net.num_params() == (12 * 8 + 8) + (8 * 8 + 8) + (8 * 3 + 3)
    assert net.forward_flops() > 0


@pytest.mark.parametrize("shape, bad", [
    ((2.7, 3, 4.2, 4), "entry 0 is 2.7 (float)"),
    ((2, 3.0, 4, 4), "entry 1 is 3.0 (float)"),
    ((True, 3), "entry 0 is True (bool)"),
    ((2, 0, 4), "entry 1 is 0 (int)"),
    ((2, -3), "entry 1 is -3 (int)"),
    ("2x3", "'2x3' (str)"),
    (5, "5 (int)"),
])
def test_input_shapes_are_positive_integers_never_truncated(shape, bad):
    with pytest.raises(dl.MinidlError) as e:
        dl.Network().input(shape, name="pixels")
    msg = str(e.value)
    assert "input 'pixels'" in msg and "shape" in msg and bad in msg, msg


def test_input_accepts_numpy_integers_and_checks_its_dtype():
    import numpy as np

    net = dl.Network()
    x = net.input((np.int64(2), np.int32(3)), name="x")
    assert x.node.shape == (2, 3) and all(type(s) is int for s in x.node.shape)
    assert net.input(np.array([4, 5]), name="y").node.shape == (4, 5)
    with pytest.raises(dl.GraphError, match="input 'z': dtype 'flaot32' is not a numpy dtype"):
        net.input((2,), dtype="flaot32", name="z")
    with pytest.raises(dl.GraphError, match="input 'w': dtype must be a float .* or an integer .*, got bool"):
        net.input((2,), dtype=bool, name="w")
    with pytest.raises(dl.GraphError, match="network 'n': dtype 'f99'"):
        dl.Network("n", dtype="f99")
