"""The compiled step (minidl.runtime.program): bit-identical to the interpreted executor under every policy, and it
refuses (falling back to interpreting) what it does not lower."""
import numpy as np
import pytest

import minidl as dl
from minidl.data import synthetic
from minidl.memory.plan import Event
from minidl.optim import SGD, Adam
from minidl.runtime.binding import BoundCall
from minidl.runtime.executor import Executor
from minidl.runtime.session import RunConfig, Session
from tests.memory.nets import NETS
from tests.planning import planned


def opt(kind="sgd"):
    return SGD(lr=0.05, momentum=0.9, weight_decay=1e-4) if kind == "sgd" else Adam(lr=1e-3, weight_decay=1e-4)


def budget_for(key, policy):
    """A budget that makes `policy` do its thing: half-way between the liveness minimum and the policy's floor."""
    if policy in ("none", "liveness"):
        return None
    live = planned(NETS[key](), opt(), "liveness").min_budget_bytes
    with pytest.raises(dl.BudgetError) as e:
        planned(NETS[key](), opt(), policy, 1)
    return (live + e.value.min_budget_bytes) // 2


def run(key, policy, compiled, steps=3, optim="sgd", trace=False, fused_update=None):
    net = NETS[key]()
    sess = Session(net, opt(optim), policy=policy, budget=budget_for(key, policy), seed=5,
                   config=RunConfig(trace=trace, fused_update=fused_update))
    if not compiled:
        sess.executor = Executor(net, sess.plan, sess.optimizer, seed=5, trace=trace, compiled=False)
    data = synthetic(16, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=2)
    losses = sess.fit(data, steps).losses
    return sess, losses


@pytest.mark.parametrize("policy", ["none", "liveness", "offload", "recompute", "auto"])
@pytest.mark.parametrize("key", ["resnet20", "dropnet"])
def test_compiled_bit_identical_to_interpreted(key, policy):
    a, la = run(key, policy, compiled=True)
    b, lb = run(key, policy, compiled=False)
    assert a.executor.program is not None, a.executor.program_fallback
    assert b.executor.program is None
    assert la == lb
    for got, ref in ((a.executor.state_dict(), b.executor.state_dict()),
                     (a.executor.optimizer_state(), b.executor.optimizer_state())):
        assert got.keys() == ref.keys()
        for k in ref:
            assert np.array_equal(got[k], ref[k]), k
    # the lowering replayed the plan on the executor's own pool: its peak is the plan's, and only the
    # persistent tensors remain, as after an interpreted step
    assert a.executor.pool.peak == a.plan.peak_bytes == b.executor.pool.peak
    assert a.executor.pool.in_use == b.executor.pool.in_use
    if policy == "offload":
        assert a.executor.program.kinds.get("offload", 0) > 0
    if key == "resnet20":
        # ReLUs right after a batch norm fold into it where nothing runs between (BN+ReLU in one pass): all ten
        # such pairs with no transfers; fewer, or none, where the plan moves tensors between the two steps
        nodes = a.net.nodes
        pairs = sum(1 for n in nodes if n.type_name == "relu" and nodes[n.inputs[0]].type_name == "batchnorm")
        kinds = a.executor.program.kinds
        fused = kinds.get("fused_batchnorm_relu", 0)
        assert fused == pairs == 10 if policy in ("none", "liveness", "recompute") else fused <= pairs
        # and those after a residual add (9 in ResNet-20: one per block)
        adds = sum(1 for n in nodes if n.type_name == "relu" and nodes[n.inputs[0]].type_name == "add")
        fused = kinds.get("fused_add_relu", 0)
        assert fused == adds == 9 if policy in ("none", "liveness", "recompute") else fused <= adds
        # where nothing but the ReLU reads the fused layer's output, it is not written: every pair under none
        # and liveness; under recompute only those whose ReLU is not recomputed (its recomputation reads it)
        kept_out = kinds.get("output_not_kept", 0)
        if policy in ("none", "liveness"):
            assert kept_out == pairs + adds
        elif policy == "recompute":
            assert 0 < kept_out < pairs + adds
        # and backwards, the ReLU's backward into the batch norm's
        fused = kinds.get("fused_batchnorm_relu_backward", 0)
        assert fused == pairs if policy in ("none", "liveness", "recompute") else fused <= pairs
        # and the ReLU's backward after an add into the add's (its gradient copied to both inputs in one pass);
        # under recompute the plan places one add's input gradient across part of the ReLU's: that one is refused
        fused = kinds.get("fused_add_relu_backward", 0)
        assert {"none": fused == adds, "liveness": fused == adds, "recompute": fused == adds - 1}.get(
            policy, fused <= adds)
    if policy == "recompute":
        assert a.executor.recomputed_flops == b.executor.recomputed_flops > 0


def test_compiled_fused_update_per_layer():
    a, la = run("resnet20", "liveness", compiled=True, fused_update=True)
    b, lb = run("resnet20", "liveness", compiled=False, fused_update=True)
    assert a.plan.route.fused_update and a.executor.program.kinds["update"] > 1
    assert la == lb
    assert all(np.array_equal(x, y) for x, y in zip(a.executor.state_dict().values(),
                                                    b.executor.state_dict().values()))


def test_compiled_adam_and_dropout_masks_per_iteration():
    a, la = run("dropnet", "liveness", compiled=True, steps=4, optim="adam")
    b, lb = run("dropnet", "liveness", compiled=False, steps=4, optim="adam")
    assert la == lb
    assert all(np.array_equal(x, y) for x, y in zip(a.executor.state_dict().values(),
                                                    b.executor.state_dict().values()))


def test_evaluate_after_compiled_steps_leaves_the_pool_as_it_was():
    sess, _ = run("resnet20", "liveness", compiled=True, steps=2)
    net = sess.net
    data = synthetic(4, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=9)
    before = sess.executor.pool.in_use
    sess.evaluate(data)
    assert sess.executor.pool.in_use == before
    sess.fit(data, 1)  # and the program still runs on the same views


def test_tracing_records_one_compute_event_per_step_like_the_interpreter():
    a, _ = run("resnet20", "liveness", compiled=True, steps=1, trace=True)
    b, _ = run("resnet20", "liveness", compiled=False, steps=1, trace=True)
    ca = [(e.name, e.step, e.in_use) for e in a.executor.trace if e.track == "compute"]
    cb = [(e.name, e.step, e.in_use) for e in b.executor.trace if e.track == "compute"]
    assert ca == cb and len(ca) == len(a.plan.steps)


def test_a_wrong_batch_shape_names_the_input():
    sess, _ = run("resnet20", "liveness", compiled=True, steps=1)
    x = np.zeros((3, 3, 16, 16), np.float32)
    with pytest.raises(dl.DataError, match=r"input 'data': images must be .* of shape \(2, 3, 16, 16\), got float32 "
                                           r"of shape \(3, 3, 16, 16\)"):
        sess.executor.train_step(x, np.zeros(3, np.int64))


def test_debug_mode_runs_the_interpreter():
    net = NETS["resnet20"]()
    sess = Session(net, opt(), policy="liveness", seed=5, config=RunConfig(debug=True))
    sess.fit(synthetic(4, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=2), 1)
    assert sess.executor.program is None and "debug" in sess.executor.program_fallback


def test_a_mechanism_added_as_an_event_handler_runs_compiled():
    """Another mechanism adds an event kind and its handler: the compiled step records the calls the handler hands
    its sink, as the interpreter runs them, with no change to minidl.runtime.program."""
    net = NETS["resnet20"]()
    sess = Session(net, opt(), policy="liveness", seed=5)
    ex = sess.executor
    seen = []
    kind = "future-mechanism"  # not an EventKind member: a kind minidl.runtime.program was written without

    def handler(ev, step, sink):
        sink(BoundCall(kind, seen.append, (step.index,), step))
    ex.add_event_handler(kind, handler)
    sess.plan.steps[1].before.append(Event(kind, "act:none"))
    sess.fit(synthetic(4, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=2), 2)
    assert ex.step_runner == "compiled" and ex.program.kinds[kind] == 1
    assert seen == [1, 1]


def test_an_event_kind_without_a_handler_is_named():
    net = NETS["resnet20"]()
    sess = Session(net, opt(), policy="liveness", seed=5)
    sess.plan.steps[1].before.append(Event("future-mechanism", "act:none"))
    with pytest.raises(dl.OptionError, match=r"kind 'future-mechanism' at step 1 \(fwd bn1\).*no handler"):
        sess.fit(synthetic(4, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=2), 1)


def test_program_and_capture_use_the_step_binding_alone():
    """The compiled step and the graph capture see the executor only through `StepBinding`: no private member,
    nothing the protocol does not name."""
    import ast
    import inspect

    from minidl.runtime import binding, capture, program

    surface = {n for n in dir(binding.StepBinding) if not n.startswith("_")} | set(
        binding.StepBinding.__annotations__)
    for module in (program, capture):
        used = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "ex") or (isinstance(v, ast.Attribute)
                                                               and v.attr in ("ex", "executor")):
                used.add(node.attr)
        assert used, module.__name__
        assert used <= surface, (module.__name__, sorted(used - surface))
