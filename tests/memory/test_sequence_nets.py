"""A one-block transformer (token and position embeddings, layer norm, causal attention, a GELU MLP, residual adds,
per-token cross-entropy with an ignore index) built with dl.Network: its loss and one step are PyTorch's, scores
rebuilt in backward and tied weights under packs keep `none`'s bits, bad batches and ties are named (every exact
policy on it and on a tied GPT-2: tests/runtime/test_policy_matrix.py)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import minidl as dl
from minidl import layers as L
from minidl.layers.loss import IGNORE_INDEX
from minidl.memory.decisions.recompute import recompute_plan
from minidl.memory.plan import EventKind
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session
from minidl.testing.torch_twin import TorchTwin
from tests.memory.nets import BLOCK, block_net
from tests.planning import planned
from tests.sessions import session_kw

B, T, V, C, HEADS = (BLOCK[k] for k in ("B", "T", "V", "C", "HEADS"))
IGNORE = IGNORE_INDEX


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, V, (B, T)).astype(np.int64)
        y = np.roll(x, -1, axis=1)
        y[:, -1] = IGNORE  # the last position has no next token
        out.append((x, y))
    return out


def train(policy, steps=4, attention=True, keep_scores=True, tied=False, **kw):
    sess = Session(block_net(attention, keep_scores, tied=tied), SGD(lr=0.1, momentum=0.9, weight_decay=1e-4),
                   policy=policy, seed=5, **session_kw(kw))
    losses = [sess.executor.train_step(x, y) for x, y in batches(steps)]
    return sess, losses


@pytest.fixture(scope="module")
def reference():
    return train("none")


def test_attention_scores_rebuilt_in_backward_train_to_the_same_bits_with_less_memory(reference):
    ref, ref_losses = reference
    sess, losses = train("liveness", keep_scores=False)
    assert losses == ref_losses
    want, got = ref.executor.state_dict(), sess.executor.state_dict()
    for k in want:
        assert np.array_equal(want[k], got[k]), k
    assert "aux:attn.probs" not in sess.plan.route.tensors
    live = planned(block_net(), SGD(lr=0.1, momentum=0.9, weight_decay=1e-4), "liveness")
    assert sess.plan.peak_bytes < live.peak_bytes


def test_recompute_rebuilds_the_cheap_layers_and_the_attention_scores_in_backward():
    """Layer norm, GELU and dropout are cheap (not checkpoints): recompute drops their outputs after forward and
    rebuilds them in backward. The attention scores are a rebuildable aux tensor: recompute plans the route without
    them too and keeps it, its peak being lower here (the parameters it trains to: the test above)."""
    opt = SGD(lr=0.1, momentum=0.9)
    plan = planned(block_net(), opt, "recompute")
    rebuilt = {ev.tensor for sp in plan.steps for ev in sp.before if ev.kind is EventKind.RECOMPUTE}
    assert {"act:ln_attn", "act:ln_mlp", "act:gelu", "act:drop", "act:ln_f"} <= rebuilt, rebuilt
    route = block_net().route(optimizer_slots=opt.slots)
    assert route.rebuildable_aux() == ["aux:attn.probs"]
    assert "aux:attn.probs" not in plan.route.tensors
    kept = recompute_plan(route)
    assert plan.peak_bytes < kept.peak_bytes
    assert all("aux:attn.probs" not in st.reads + st.writes for st in plan.route.steps)


def test_loss_decreases_and_matches_torch(reference):
    _, losses = reference
    assert losses[-1] < losses[0]
    net = block_net()
    sess = Session(net, SGD(lr=0.1), policy="none", seed=5)
    state = sess.executor.state_dict()
    twin = TorchTwin(net, state, dtype=torch.float32)
    twin.fns[net.node("drop").index] = lambda xs, p: xs[0]  # evaluation: dropout is the identity
    x, y = batches(1)[0]
    want, _ = twin.forward(torch.tensor(x), torch.tensor(y))
    got, logits = sess.executor.evaluate(x, y)
    assert logits.shape == (B, T, V)
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)


def test_each_batch_is_checked_tokens_against_the_table_labels_against_the_vocabulary():
    sess = Session(block_net(attention=False), SGD(lr=0.1), policy="liveness")
    x, y = batches(1)[0]
    bad = x.copy()
    bad[1, 2] = V
    with pytest.raises(dl.DataError, match=rf"input 'tokens': index {V} is outside \[0, {V}\)"):
        sess.executor.train_step(bad, y)
    bad = y.copy()
    bad[0, 0] = -2
    with pytest.raises(dl.DataError, match=rf"input 'targets': label -2 is outside \[0, {V}\)"):
        sess.executor.train_step(x, bad)
    assert sess.executor.iteration == 0
    sess.executor.train_step(x, y)  # IGNORE on the last position is accepted


def test_a_backend_without_a_layers_kernels_is_refused_naming_the_layer():
    """The CUDA backend has no layer norm, GELU, embedding or attention kernels yet: a network that needs them is
    refused before any step, naming the first layer and the missing kernels (here a CPU backend without them)."""
    from minidl.backend.cpu.backend import CPUBackend

    class NoSequenceKernels(CPUBackend):
        capabilities = replace(CPUBackend.capabilities, kernels=frozenset())

    with pytest.raises(dl.OptionError, match=r"layer 'wte' \(embedding\) cannot run on backend 'cpu': its kernels "
                                             r"\(embedding_forward, embedding_backward\) are not yet written"):
        Session(block_net(), SGD(lr=0.1), policy="liveness", backend=NoSequenceKernels())


@pytest.mark.parametrize("tied", [False, True])
def test_one_training_step_matches_pytorch_in_float64(tied):
    """Forward, backward through every layer (attention, layer norms, embeddings, ignored targets) and one SGD
    step, in float64 without dropout: the loss and every updated parameter are PyTorch's. Tied, the token table
    is one tensor read by the embedding and the head: its gradient is the sum of both uses, as PyTorch's is."""
    net = block_net(dtype="float64", dropout=0.0, tied=tied)
    sess = Session(net, SGD(lr=0.1), policy="liveness", seed=5)
    before = {k: np.array(v) for k, v in sess.executor.state_dict().items()}
    twin = TorchTwin(net, before, dtype=torch.float64)
    x, y = batches(1)[0]
    loss = sess.executor.train_step(x, y)
    want, _ = twin.forward(torch.tensor(x), torch.tensor(y))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-12)
    after, grads = sess.executor.state_dict(), twin.grads()
    assert grads.keys() == after.keys()
    for k in after:
        np.testing.assert_allclose(after[k], before[k] - 0.1 * grads[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_a_tied_head_is_one_parameter():
    plain, tied = block_net(), block_net(tied=True)
    assert plain.num_params() - tied.num_params() == V * C
    sess = Session(tied, SGD(lr=0.1), policy="liveness", seed=5)
    assert "head.weight" not in sess.executor.state_dict() and "wte.weight" in sess.executor.state_dict()
    route = tied.route(optimizer_slots=())
    assert "param:head.weight" not in route.tensors
    fwd = next(st for st in route.forward_steps if st.name == "head")
    assert "param:wte.weight" in fwd.reads
    owner = next(st for st in route.backward_steps if st.name == "wte")
    assert [(a.partial, a.into) for a in owner.accumulate] == [("grad:head.weight", "grad:wte.weight")]


@pytest.mark.parametrize("policy,fraction", [("liveness", None), ("packs", None), ("packs", 0.6)])
def test_tied_weights_under_micro_batches_and_packs_match_none(policy, fraction):
    """With 2 micro-batches the head's two contributions are summed before the owner adds them in (at the owner's
    last micro-batch), whether the owner shares the head's pack or not: the same bits as `none` micro-batched."""
    opt = lambda: SGD(lr=0.1, momentum=0.9)  # noqa: E731
    net = lambda: block_net(tied=True)  # noqa: E731
    budget = None if fraction is None else int(planned(net(), opt(), "liveness").peak_bytes * fraction)
    ref = Session(net(), opt(), policy="none", seed=5, micro_batches=2)
    got = Session(net(), opt(), policy=policy, seed=5, micro_batches=2, budget=budget,
                  config=RunConfig(debug=True))
    packs = got.plan.route.packing.packs
    assert any("wte" in p and "head" in p for p in packs) == (policy == "packs" and fraction is None)
    for x, y in batches(3):
        assert ref.executor.train_step(x, y) == got.executor.train_step(x, y)
    want, have = ref.executor.state_dict(), got.executor.state_dict()
    for k in want:
        assert np.array_equal(want[k], have[k]), k


@pytest.mark.parametrize("param,to,match", [
    ("head.weight", "fc.weight", r"shapes differ: head.weight is \(11, 16\), fc.weight is \(64, 16\)"),
    ("wte.weight", "head.weight", r"the owner 'head' must come before 'wte'"),
    ("head.bias", "wte.weight", r"layer 'head' \(linear\) has no own parameter 'bias' \(it has: weight\)"),
    ("nohead.weight", "wte.weight", r"param='nohead.weight' names no layer"),
])
def test_bad_ties_are_graph_errors_naming_both(param, to, match):
    with pytest.raises(dl.GraphError, match=match):
        block_net().tie(param, to=to)



def test_a_planned_network_is_frozen_so_a_late_tie_cannot_split_training_from_checkpoints():
    from minidl.core.symbol import Symbol

    net = block_net()
    sess = Session(net, SGD(lr=0.1), policy="liveness")
    keys = sorted(sess.executor.state_dict())
    with pytest.raises(dl.GraphError, match=r"tie\('head.weight', to='wte.weight'\) after a Session planned it"):
        net.tie("head.weight", to="wte.weight")
    with pytest.raises(dl.GraphError, match=r"adding 'late' \(relu\) after a Session planned it"):
        L.ReLU(name="late")(Symbol(net, net.node("ln_f").index))
    assert "late" not in {n.name for n in net.nodes} and "weight" in net.node("head").params
    assert sorted(sess.executor.state_dict()) == keys and any("head" in k for k in keys)
