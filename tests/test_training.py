"""End-to-end training: a small CNN learns the bundled digits."""
from minidl.data import load_data
from minidl.models import build_model
from minidl.optim import SGD
from minidl.session import Session


def test_lenet_learns_digits_to_95_percent():
    train, heldout = load_data("digits", seed=0)
    net = build_model("lenet", batch=32, image_size=8, in_channels=1, num_classes=10)
    sess = Session(net, SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0)
    # 600 steps: at 400 the held-out accuracy (93-97% across seeds) sat so near 95% that a change of summation
    # order in the convolution (the row-shift kernels) flipped the outcome for seed 0; at 600 it is ~98.6%.
    sess.fit(train, 600)
    loss, acc = sess.evaluate(heldout)
    assert acc >= 0.95, (loss, acc)
