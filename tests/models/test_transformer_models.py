"""GPT-2 and BERT in the zoo: the published parameter counts, and two-layer models against PyTorch twins written here
by hand (HuggingFace's layout, their own forward): same loss, same gradients, tied tables included."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidl as dl
from minidl.models import bert, build_model, gpt2
from minidl.optim import SGD
from minidl.runtime.session import Session
from tests.planning import planned


# -- PyTorch twins: every tensor's name and shape, as HuggingFace lays them out (the tied head has none) -----------
def gpt2_shapes(layers: int, width: int, vocab: int = 50257, positions: int = 1024) -> dict[str, tuple]:
    c = width
    out = {"wte.weight": (vocab, c), "wpe.weight": (positions, c)}
    for i in range(layers):
        b = f"h{i}"
        out |= {f"{b}.ln_1.weight": (c,), f"{b}.ln_1.bias": (c,),
                f"{b}.attn.c_attn.weight": (3 * c, c), f"{b}.attn.c_attn.bias": (3 * c,),
                f"{b}.attn.c_proj.weight": (c, c), f"{b}.attn.c_proj.bias": (c,),
                f"{b}.ln_2.weight": (c,), f"{b}.ln_2.bias": (c,),
                f"{b}.mlp.c_fc.weight": (4 * c, c), f"{b}.mlp.c_fc.bias": (4 * c,),
                f"{b}.mlp.c_proj.weight": (c, 4 * c), f"{b}.mlp.c_proj.bias": (c,)}
    return out | {"ln_f.weight": (c,), "ln_f.bias": (c,)}


def bert_shapes(layers: int, width: int, vocab: int = 30522, positions: int = 512) -> dict[str, tuple]:
    """BertForMaskedLM's tensors but the token-type table (one segment per sequence); q, k, v as one (3C, C)."""
    c = width
    out = {"word_embeddings.weight": (vocab, c), "position_embeddings.weight": (positions, c),
           "embeddings.ln.weight": (c,), "embeddings.ln.bias": (c,)}
    for i in range(layers):
        b = f"layer{i}"
        out |= {f"{b}.attention.qkv.weight": (3 * c, c), f"{b}.attention.qkv.bias": (3 * c,),
                f"{b}.attention.out.weight": (c, c), f"{b}.attention.out.bias": (c,),
                f"{b}.attention.ln.weight": (c,), f"{b}.attention.ln.bias": (c,),
                f"{b}.intermediate.weight": (4 * c, c), f"{b}.intermediate.bias": (4 * c,),
                f"{b}.output.weight": (c, 4 * c), f"{b}.output.bias": (c,),
                f"{b}.output.ln.weight": (c,), f"{b}.output.ln.bias": (c,)}
    return out | {"mlm.transform.weight": (c, c), "mlm.transform.bias": (c,), "mlm.ln.weight": (c,),
                  "mlm.ln.bias": (c,), "mlm.decoder.bias": (vocab,)}


def torch_count(shapes: dict[str, tuple]) -> int:
    """The twin's parameters, made on PyTorch's meta device (no memory: GPT-2 XL is 6 GB in float32)."""
    return sum(torch.empty(s, device="meta").numel() for s in shapes.values())


def attention(x, w, b, heads: int, causal: bool):
    bsz, t, c = x.shape
    q, k, v = (a.reshape(bsz, t, heads, c // heads).transpose(1, 2) for a in F.linear(x, w, b).split(c, dim=2))
    s = q @ k.transpose(-1, -2) / math.sqrt(c // heads)
    if causal:
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, c)


def gpt2_twin(p: dict, tokens, targets, layers: int, heads: int):
    t = tokens.shape[1]
    x = F.embedding(tokens, p["wte.weight"]) + p["wpe.weight"][:t]
    for i in range(layers):
        b = f"h{i}."

        def ln(n, a, b=b):
            return F.layer_norm(a, a.shape[-1:], p[b + n + ".weight"], p[b + n + ".bias"], 1e-5)

        a = attention(ln("ln_1", x), p[b + "attn.c_attn.weight"], p[b + "attn.c_attn.bias"], heads, True)
        x = x + F.linear(a, p[b + "attn.c_proj.weight"], p[b + "attn.c_proj.bias"])
        m = F.gelu(F.linear(ln("ln_2", x), p[b + "mlp.c_fc.weight"], p[b + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(m, p[b + "mlp.c_proj.weight"], p[b + "mlp.c_proj.bias"])
    x = F.layer_norm(x, x.shape[-1:], p["ln_f.weight"], p["ln_f.bias"], 1e-5)
    logits = F.linear(x, p["wte.weight"])  # the tied head
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def bert_twin(p: dict, tokens, targets, layers: int, heads: int):
    def ln(n, a):
        return F.layer_norm(a, a.shape[-1:], p[n + ".weight"], p[n + ".bias"], 1e-12)

    t = tokens.shape[1]
    x = ln("embeddings.ln", F.embedding(tokens, p["word_embeddings.weight"]) + p["position_embeddings.weight"][:t])
    for i in range(layers):
        b = f"layer{i}."
        a = attention(x, p[b + "attention.qkv.weight"], p[b + "attention.qkv.bias"], heads, False)
        x = ln(b + "attention.ln", x + F.linear(a, p[b + "attention.out.weight"], p[b + "attention.out.bias"]))
        m = F.gelu(F.linear(x, p[b + "intermediate.weight"], p[b + "intermediate.bias"]))
        x = ln(b + "output.ln", x + F.linear(m, p[b + "output.weight"], p[b + "output.bias"]))
    x = ln("mlm.ln", F.gelu(F.linear(x, p["mlm.transform.weight"], p["mlm.transform.bias"])))
    logits = F.linear(x, p["word_embeddings.weight"], p["mlm.decoder.bias"])  # the tied decoder
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


# -- parameter counts ------------------------------------------------------------------------------------------------
GPT2_PARAMS = {"small": 124_439_808, "medium": 354_823_168, "large": 774_030_080, "xl": 1_557_611_200}
GPT2_SIZES = {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280), "xl": (48, 1600)}
BERT_PARAMS = {"base": 109_512_762, "large": 335_172_410, "96": 1_242_100_538}
BERT_SIZES = {"base": (12, 768), "large": (24, 1024), "96": (96, 1024)}


@pytest.mark.parametrize("size", list(GPT2_PARAMS))
def test_gpt2_parameter_counts_are_the_published_ones(size):
    net = build_model(f"gpt2-{size}")
    assert net.num_params() == GPT2_PARAMS[size] == torch_count(gpt2_shapes(*GPT2_SIZES[size]))
    assert build_model("gpt2", size=size).num_params() == GPT2_PARAMS[size]


@pytest.mark.parametrize("size", list(BERT_PARAMS))
def test_bert_parameter_counts_match_the_twin(size):
    name = "bert-96" if size == "96" else f"bert-{size}"
    net = build_model(name)
    assert net.num_params() == BERT_PARAMS[size] == torch_count(bert_shapes(*BERT_SIZES[size]))
    # HuggingFace's BertForMaskedLM has the token-type table (2 x C) besides: 335,174,458 for BERT-large
    assert net.num_params() + 2 * BERT_SIZES[size][1] == {"base": 109_514_298, "large": 335_174_458,
                                                            "96": 1_242_102_586}[size]


def test_untied_gpt2_has_a_head_of_its_own():
    assert gpt2(tied=False).num_params() == GPT2_PARAMS["small"] + 50257 * 768


# -- two layers against the twins ----------------------------------------------------------------------------------
def _against_twin(net, twin, shapes, vocab, layers, heads):
    sess = Session(net, SGD(lr=0.1), policy="liveness", seed=3)
    state = sess.executor.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    rng = np.random.default_rng(0)
    b, t = net.input_nodes[0].shape
    x = rng.integers(0, vocab, (b, t)).astype(np.int64)
    y = rng.integers(0, vocab, (b, t)).astype(np.int64)
    y[0, :3] = -100  # ignored positions
    p = {k: torch.tensor(v, requires_grad=True) for k, v in state.items()}
    want = twin(p, torch.tensor(x), torch.tensor(y), layers, heads)
    want.backward()
    loss = sess.executor.train_step(x, y)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-11)
    after = sess.executor.state_dict()
    for k in state:  # one SGD step at lr 0.1: the parameters moved by 0.1 times PyTorch's gradients
        np.testing.assert_allclose((state[k] - after[k]) / 0.1, p[k].grad.numpy(), rtol=1e-7, atol=1e-9, err_msg=k)


def test_two_layer_gpt2_matches_its_pytorch_twin_in_float64():
    net = gpt2(layers=2, heads=2, width=16, seq=7, batch=3, vocab=23, positions=9, dropout=0.0, dtype="float64")
    _against_twin(net, gpt2_twin, gpt2_shapes(2, 16, 23, 9), 23, 2, 2)


def test_two_layer_bert_matches_its_pytorch_twin_in_float64():
    net = bert(layers=2, heads=2, width=16, seq=7, batch=3, vocab=23, positions=9, dropout=0.0, dtype="float64")
    _against_twin(net, bert_twin, bert_shapes(2, 16, 23, 9), 23, 2, 2)


# -- the registry ----------------------------------------------------------------------------------------------------
def test_sequence_models_in_the_registry():
    net = build_model("gpt2", layers=4, width=128, heads=4, seq=64, batch=2, num_classes=256)
    assert net.node("tokens").shape == (2, 64) and net.node("lm_head").shape == (2, 64, 256)
    assert net.node("wpe").params["weight"].shape == (1024, 128)
    assert build_model("gpt2", seq=2048, layers=1).node("wpe").params["weight"].shape == (2048, 768)
    assert build_model("bert96", batch=1).name == "bert96"
    with pytest.raises(dl.OptionError, match=r"model 'gpt2' reads token sequences: it has no image_size option"):
        build_model("gpt2", image_size=32)
    with pytest.raises(dl.OptionError, match=r"model 'bert': unknown size 'huge'; choose one of base, large, 96"):
        build_model("bert", size="huge")
    with pytest.raises(dl.OptionError, match=r"model 'gpt2': width 100 is not a multiple of heads=12"):
        build_model("gpt2", width=100)
    with pytest.raises(dl.OptionError, match=r"fixes size='xl'"):
        build_model("gpt2-xl", size="small")


def test_a_sequence_models_kind_says_what_it_trains_on():
    """The registry, not the command line, knows each model's objective: gpt2 the next token, bert masked tokens
    (and the vocabulary byte-level text gives each: 256 bytes, bert's with [MASK])."""
    from minidl.data.text import text_vocab
    from minidl.models import MODELS, is_sequence_model, model_objective

    assert model_objective("gpt2") == model_objective("gpt2-xl") == "next-token"
    assert model_objective("bert") == model_objective("bert-96") == model_objective("BERT_large") == "masked"
    assert model_objective("resnet50") is None and model_objective("nope") is None
    assert all(is_sequence_model(k) == (spec.objective is not None) for k, spec in MODELS.items())
    assert (text_vocab("next-token"), text_vocab("masked")) == (256, 257)


# -- the command line ------------------------------------------------------------------------------------------------
def _json(capsys, *argv):
    import json

    from minidl.cli import main

    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_info_names_the_published_counts(capsys):
    assert _json(capsys, "info", "gpt2", "--size", "xl")["params"] == GPT2_PARAMS["xl"]
    assert _json(capsys, "info", "gpt2", "--config", "small")["params"] == GPT2_PARAMS["small"]
    assert _json(capsys, "info", "bert-96")["params"] == BERT_PARAMS["96"]
    assert _json(capsys, "info", "bert", "--size", "large")["params"] == BERT_PARAMS["large"]
    r = _json(capsys, "info", "gpt2", "--layers", "4", "--width", "128", "--heads", "4", "--seq", "128")
    assert r["params"] == torch_count(gpt2_shapes(4, 128))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "offload", "window", "packs", "auto"])
@pytest.mark.parametrize("model", [["gpt2", "--size", "xl"], ["bert-96"]])
def test_the_harmony_transformers_plan_under_every_policy(capsys, model, policy):
    """Full-size GPT-2 XL and BERT-96 (batch 2, 128 tokens: Harmony's depth and width) plan under each policy; packs
    and auto, which may home weights on the host, also at 80% of liveness's peak (weights, gradients and momentum
    are most of it), which they then respect."""
    args = ["plan", *model, "--batch", "2", "--seq", "128", "--device", "v100"]
    live = _json(capsys, *args, "--policy", "liveness")["peak_bytes"]
    r = _json(capsys, *args, "--policy", policy)
    assert r["peak_bytes"] <= live or policy == "window"
    if policy in ("packs", "auto"):
        r = _json(capsys, *args, "--policy", policy, "--budget", str(int(live * 0.8)))
        assert r["peak_bytes"] <= live * 0.8, r["peak_bytes"]


def test_auto_leaves_the_attention_scores_out_where_only_that_fits():
    """The scores (B H T^2 a layer) live from forward to backward whatever else moves: auto searches the route
    without them too when nothing fits with them, and plans at the budget that route needs."""
    import minidl as dl

    def net(keep):
        return gpt2(layers=2, heads=2, width=16, seq=64, batch=4, vocab=32, dropout=0.0, keep_scores=keep)

    with pytest.raises(dl.BudgetError) as e:
        planned(net(False), SGD(lr=0.1, momentum=0.9), "auto", budget=1)
    plan = planned(net(True), SGD(lr=0.1, momentum=0.9), "auto", budget=e.value.min_budget_bytes)
    assert plan.route.rebuildable_aux() == [] and plan.peak_bytes <= e.value.min_budget_bytes


@pytest.fixture(scope="module")
def tiny_gpt_none():
    return _train_tiny_gpt("none")


def _tiny_gpt():
    return gpt2(layers=2, heads=2, width=16, seq=16, batch=4, vocab=40, dropout=0.1)


def _train_tiny_gpt(policy, budget=None):
    sess = Session(_tiny_gpt(), SGD(lr=0.1, momentum=0.9), policy=policy, budget=budget, seed=1)
    rng = np.random.default_rng(2)
    losses = []
    for _ in range(3):
        x = rng.integers(0, 40, (4, 17))
        losses.append(sess.executor.train_step(x[:, :-1].copy(), x[:, 1:].copy()))
    return sess, losses


def test_compress_trains_the_zoo_gpt2_close_to_none_and_the_executor_peak_is_the_plans(tiny_gpt_none):
    """The lossy policy (opt-in) stores some of GPT-2's activations compressed between forward and backward: the
    losses stay close to `none`'s (not equal: it is lossy), with less memory, and the executor measures the plan's
    peak byte for byte."""
    from minidl.memory.plan import EventKind

    ref, ref_losses = tiny_gpt_none
    sess, losses = _train_tiny_gpt("compress")
    assert any(ev.kind is EventKind.COMPRESS for sp in sess.plan.steps for ev in sp.before + sp.after)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    assert sess.executor.pool.peak == sess.plan.peak_bytes < ref.plan.peak_bytes


def test_a_packed_route_keeps_one_micro_batchs_scores_at_a_time():
    """On Harmony's route the pack's re-forward writes the attention scores into a tensor of its own, read by the
    micro-batch's backward right after: no micro-batch's scores live from the forward into backward (kept from the
    forward, every micro-batch's would be: the whole batch's, whatever the count). Same bits as `none` on the same
    micro-batches."""
    from minidl.core.tensors import Role
    from minidl.memory.liveness import analyze

    net = _tiny_gpt()
    route = net.route(optimizer_slots=("momentum",), micro_batches=2, packs=[[n.name] for n in net.layer_nodes])
    iv = analyze(route)
    scores = [t for t in route.tensors if t.startswith("aux:") and ".attn.probs" in t]
    assert sorted(scores) == [f"aux:h{i}.attn.probs@{m}r" for i in range(2) for m in range(2)]
    assert all(iv[t].first >= route.turn for t in scores)
    assert all(iv[t].last - iv[t].first == 1 for t in scores)   # written by the re-forward, read by the backward
    assert all(route.tensors[t].role is Role.AUX for t in scores)

    def run(policy, budget=None):
        sess = Session(_tiny_gpt(), SGD(lr=0.1, momentum=0.9), policy=policy, budget=budget, seed=1, micro_batches=2)
        rng = np.random.default_rng(2)
        losses = []
        for _ in range(2):
            x = rng.integers(0, 40, (4, 17))
            losses.append(sess.executor.train_step(x[:, :-1].copy(), x[:, 1:].copy()))
        return sess, losses

    ref, ref_losses = run("none")
    got, losses = run("packs", int(ref.plan.peak_bytes * 0.5))
    assert losses == ref_losses and got.executor.pool.peak == got.plan.peak_bytes
    want, have = ref.executor.state_dict(), got.executor.state_dict()
    for k in want:
        assert np.array_equal(want[k], have[k]), k
