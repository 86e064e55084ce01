"""End-to-end training: a small CNN learns the bundled digits."""
from minidl.data import load_data
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session


def test_lenet_learns_digits_to_95_percent():
    train, heldout = load_data("digits", seed=0)
    net = build_model("lenet", batch=32, image_size=8, in_channels=1, num_classes=10)
    sess = Session(net, SGD(lr=0.02, momentum=0.9), policy="liveness", seed=0)
    # lr 0.02 for 800 steps: at lr 0.05 the held-out accuracy swung between 93% and 98% from one hundred steps
    # to the next, so any change of a kernel's summation order (the row-shift convolutions') could land it under
    # 95%; at 0.02 it climbs steadily to 97.8-98.3% at 700-800 steps (seeds 0 and 1, either summation order).
    sess.fit(train, 800)
    loss, acc = sess.evaluate(heldout)
    assert acc >= 0.95, (loss, acc)
