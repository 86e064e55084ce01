"""The sequence layers on a real GPU (`python -m pytest -q -m gpu`; skipped, with the reason, without one).

The one-block transformer of tests/memory/test_sequence_nets.py (embeddings, layer norms, causal attention, a GELU
MLP with dropout, residual adds, per-token cross-entropy with an ignore index) trained on the CUDA backend:
within float32 rounding of the CPU backend's run, and, on the GPU, bit-identical across what must not change the
bits: the attention scores kept or rebuilt in backward, every exact policy against `none`, graph replay against
the eager loop. Op by op: tests/backend/test_cuda_sequence.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session
from tests.memory.test_sequence_nets import batches, block_net
from tests.planning import planned

from .test_capture_gpu import _cuda

pytestmark = pytest.mark.gpu


def _opt():
    return SGD(lr=0.1, momentum=0.9, weight_decay=1e-4)


def _train(backend=None, policy="none", keep_scores=True, graphs=True, budget=None, steps=4):
    sess = Session(block_net(keep_scores=keep_scores), _opt(), policy=policy, budget=budget, seed=5,
                   backend=backend, config=RunConfig(graphs=graphs))
    losses = [sess.executor.train_step(x, y) for x, y in batches(steps)]
    return sess, losses, {k: np.array(v, copy=True) for k, v in sess.executor.state_dict().items()}


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_a_transformer_block_trains_on_cuda_as_on_the_cpu():
    _, cpu_losses, cpu_params = _train()
    sess, losses, params = _train(_cuda())
    print(f"cuda step runner: {sess.executor.step_runner}; {sess.executor.graph_fallback}")
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-4)
    for k in cpu_params:
        np.testing.assert_allclose(params[k], cpu_params[k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_attention_scores_rebuilt_on_cuda_give_the_kept_bits():
    _, kept_losses, kept = _train(_cuda())
    _, rebuilt_losses, rebuilt = _train(_cuda(), keep_scores=False)
    assert rebuilt_losses == kept_losses
    _same_bits(kept, rebuilt)


def test_graph_replay_of_a_transformer_block_is_bit_identical_to_eager():
    sess, lg, pg = _train(_cuda(), graphs=True)
    _, le, pe = _train(_cuda(), graphs=False)
    print(f"graphs: {sess.executor.step_runner}; {sess.executor.graph_fallback}")
    assert lg == le
    _same_bits(pg, pe)


@pytest.mark.parametrize("policy", ["liveness", "recompute", "offload", "window"])
def test_exact_policies_train_a_transformer_block_bit_identically_on_cuda(policy):
    _, ref_losses, ref = _train(_cuda())
    budget = None
    if policy in ("offload", "window"):  # under 90% of liveness's peak they must move tensors
        budget = int(planned(block_net(), _opt(), "liveness").peak_bytes * 0.9)
    sess, losses, params = _train(_cuda(), policy=policy, budget=budget)
    print(f"{policy}: {sess.executor.step_runner}; {sess.executor.graph_fallback}")
    assert losses == ref_losses
    _same_bits(ref, params)
