"""Small networks shared by the memory tests: ResNet-20 (adds), a tiny DenseNet (concats), and a net with BN and
dropout (recomputation must reuse BN's batch statistics and replay the dropout mask) in `NETS`; beside them the
policy matrix's others: LeNet, a narrow VGG-11 (a chain whose ReLU outputs, not conv outputs, reach backward), a
transformer block and a two-block GPT-2 (tied head)."""
import minidl as dl
from minidl import layers as L
from minidl.layers import BatchNorm2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.layers.loss import IGNORE_INDEX
from minidl.models import build_model
from minidl.models.vgg import VGG_CONFIGS
from tests import sessions
from tests.sessions import data_for, opt

__all__ = ["NETS", "block_net", "data_for", "dropnet", "lenet", "opt", "reference_states", "resnet8", "tiny_gpt2",
           "train", "vgg11_narrow"]


def dropnet(batch=4):
    """conv-BN-ReLU-pool twice, then linear-ReLU-dropout-linear: BN in training mode and a dropout mask."""
    net = dl.Network("dropnet")
    x = net.input((batch, 3, 12, 12), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = x
    for i, c in enumerate((6, 8)):
        h = Conv2d(c, 3, padding=1, name=f"conv{i}")(h)
        h = BatchNorm2d(name=f"bn{i}")(h)
        h = ReLU(name=f"relu{i}")(h)
        h = MaxPool2d(2, name=f"pool{i}")(h)
    h = Flatten(name="flat")(h)
    h = ReLU(name="fc_relu")(Linear(16, name="fc1")(h))
    h = Dropout(0.5, name="drop")(h)
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc2")(h), y))
    return net


NETS = {
    "resnet20": lambda: build_model("resnet", depth=20, batch=2, image_size=16, num_classes=10),
    "densenet_tiny": lambda: build_model("densenet", variant="tiny", batch=2, image_size=16, num_classes=10),
    "dropnet": dropnet,
}


def resnet8(batch=2):
    """ResNet-8 at 8 px: ResNet-20's blocks (adds, projections, BN), once each."""
    return build_model("resnet", depth=8, batch=batch, image_size=8, num_classes=10)


def lenet(batch=4):
    return build_model("lenet", batch=batch, image_size=28, in_channels=1, num_classes=10)


def vgg11_narrow(batch=2, size=32, width=8):
    """VGG-11's layer sequence (configuration A) with channels / `width` and a small classifier: the real VGG-11
    needs 224 px and 1.6 GB of training state, too much for a fast test."""
    net = dl.Network("vgg11_narrow")
    h = net.input((batch, 3, size, size), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    for s, widths in enumerate(VGG_CONFIGS[11], start=1):
        for i, c in enumerate(widths, start=1):
            h = ReLU(name=f"relu{s}_{i}")(Conv2d(c // width, 3, padding=1, name=f"conv{s}_{i}")(h))
        h = MaxPool2d(2, stride=2, name=f"pool{s}")(h)
    for i in (6, 7):
        h = Dropout(0.5, name=f"drop{i}")(ReLU(name=f"relu{i}")(Linear(32, name=f"fc{i}")(h)))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(10, name="fc8")(h), y))
    return net


BLOCK = dict(B=4, T=8, V=11, C=16, HEADS=2)


def block_net(attention: bool = True, keep_scores: bool = True, dtype="float32", dropout: float = 0.1,
              tied: bool = False):
    """embedding (+ positions) -> [layernorm -> attention -> add] -> layernorm -> linear -> gelu -> linear -> add ->
    layernorm -> linear (vocabulary) -> per-token cross-entropy. `tied`: the vocabulary projection reads the token
    embedding's table (GPT-2's weight tying)."""
    B, T, V, C, HEADS = (BLOCK[k] for k in ("B", "T", "V", "C", "HEADS"))
    net = dl.Network("gpt1", dtype=dtype)
    tok = net.input((B, T), dtype="int64", name="tokens")
    tgt = net.input((B, T), dtype="int64", name="targets")
    h = L.Embedding(V, C, name="wte")(tok)
    h = L.PositionEmbedding(T, name="wpe")(h)
    if attention:
        a = L.LayerNorm(name="ln_attn")(h)
        a = L.Linear(3 * C, flatten=False, name="qkv")(a)
        a = L.CausalSelfAttention(HEADS, keep_scores=keep_scores, name="attn")(a)
        a = L.Linear(C, flatten=False, name="proj")(a)
        h = L.Add(name="res_attn")(h, a)
    m = L.LayerNorm(name="ln_mlp")(h)
    m = L.Linear(4 * C, flatten=False, name="fc")(m)
    m = L.GELU("tanh", name="gelu")(m)
    m = L.Dropout(dropout, name="drop")(m)
    m = L.Linear(C, flatten=False, name="fc_out")(m)
    h = L.Add(name="res_mlp")(h, m)
    h = L.LayerNorm(name="ln_f")(h)
    logits = L.Linear(V, bias=False, flatten=False, name="head")(h)
    net.set_loss(L.SoftmaxCrossEntropy(ignore_index=IGNORE_INDEX, name="loss")(logits, tgt))
    if tied:
        net.tie("head.weight", to="wte.weight")
    return net


def tiny_gpt2(batch=4):
    """GPT-2 from the zoo at two blocks of width 16 (tied head, dropout)."""
    return build_model("gpt2", layers=2, heads=2, width=16, seq=16, batch=batch, num_classes=40)


def train(key, policy, budget=None, steps=5, n=32, seed=3, nets=None, **kw):
    """`sessions.train` of `nets[key]()` (default: NETS)."""
    return sessions.train((NETS if nets is None else nets)[key](), policy, budget, steps, n, seed, **kw)


def reference_states(train_fn):
    """key -> the parameters after `train_fn(key, "none")`, trained once per key (wrap in a module fixture)."""
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = train_fn(key, "none").executor.state_dict()
        return cache[key]
    return get
