"""Small networks shared by the memory tests: ResNet-20 (adds), a tiny DenseNet (concats), and a net with BN and
dropout (recomputation must reuse BN's batch statistics and replay the dropout mask)."""
import minidl as dl
from minidl.data import synthetic
from minidl.layers import BatchNorm2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session
from tests.sessions import session_kw


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


def opt():
    """The optimizer every bit-identity test trains with (momentum and weight decay: state to plan)."""
    return SGD(lr=0.05, momentum=0.9, weight_decay=1e-4)


def data_for(net, n=32, seed=0):
    """Synthetic samples shaped for `net`'s input and classes."""
    return synthetic(n, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=seed)


def train(key, policy, budget=None, steps=5, n=32, seed=3, nets=None, **kw):
    """`steps` steps of `nets[key]` (default: NETS) on `n` synthetic samples under `policy`: the run every policy
    is compared on."""
    net = (NETS if nets is None else nets)[key]()
    sess = Session(net, opt(), policy=policy, budget=budget, seed=seed, **session_kw(kw))
    sess.fit(data_for(net, n), steps)
    return sess


def reference_states(train_fn):
    """key -> the parameters after `train_fn(key, "none")`, trained once per key (wrap in a module fixture)."""
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = train_fn(key, "none").executor.state_dict()
        return cache[key]
    return get
