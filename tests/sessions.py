"""The tests' one way to train: `train(net, policy, budget, steps, **kw)` on `data_for(net)` (images, or token
sequences for a network that reads tokens) with `opt()`, and `same_state` to compare two runs bit for bit. Helpers
that build sessions take `Session`'s keywords and `RunConfig`'s fields alike, so that a test names only what it
varies (`train(..., debug=True)`); `session_kw` moves the fields into one `config`."""
from __future__ import annotations

from dataclasses import fields

import numpy as np

from minidl.data import synthetic
from minidl.data.text import SequenceDataset
from minidl.layers.loss import IGNORE_INDEX
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session

CONFIG_FIELDS = frozenset(f.name for f in fields(RunConfig))


def session_kw(kw: dict) -> dict:
    """`kw` with its RunConfig fields gathered into `config` (one given as `config=` already is kept)."""
    rest = {k: v for k, v in kw.items() if k not in CONFIG_FIELDS}
    picked = {k: v for k, v in kw.items() if k in CONFIG_FIELDS}
    if picked:
        if rest.get("config") is not None:
            raise TypeError(f"give {sorted(picked)} either as keywords or in config=, not both")
        rest["config"] = RunConfig(**picked)
    return rest


def opt():
    """The optimizer every bit-identity test trains with (momentum and weight decay: state to plan)."""
    return SGD(lr=0.05, momentum=0.9, weight_decay=1e-4)


def data_for(net, n=32, seed=0):
    """`n` samples shaped for `net`: synthetic images and classes, or random token sequences whose targets are the
    next tokens (the last position ignored) for a network whose input is int64 tokens."""
    node = net.input_nodes[0]
    classes = net.logits_node.shape[-1]
    if np.dtype(node.dtype).kind != "i":
        return synthetic(n, node.shape[1:], classes, seed=seed)
    x = np.random.default_rng(seed).integers(0, classes, (n, node.shape[1] + 1))
    y = x[:, 1:].copy()
    y[:, -1] = IGNORE_INDEX
    return SequenceDataset(x[:, :-1], y, classes, "tokens")


def train(net, policy="none", budget=None, steps=3, n=16, seed=3, optimizer=None, data_seed=0, plan=None,
          **kw) -> Session:
    """`steps` steps of `net` under `policy` on `data_for(net, n, data_seed)`, seeded with `seed`: the run policies
    are compared on (`last_fit`: its TrainResult). `plan`: one made outside the registry (a forced mode, a composed
    schedule), run instead of the policy's. `kw`: Session's keywords and RunConfig's fields."""
    sess = Session(net, optimizer or opt(), policy=policy, budget=budget, seed=seed, **session_kw(kw))
    if plan is not None:
        from minidl.runtime.executor import Executor

        sess.plan = plan
        sess.executor = Executor(net, plan, sess.optimizer, seed=seed, debug=sess.config.debug)
    sess.last_fit = sess.fit(data_for(net, n, data_seed), steps)
    return sess


def same_state(a: Session, b: Session) -> None:
    """`a` and `b` hold the same parameters and optimizer state, bit for bit."""
    for got, want in ((a.executor.state_dict(), b.executor.state_dict()),
                      (a.executor.optimizer_state(), b.executor.optimizer_state())):
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), name
