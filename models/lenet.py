"""LeNet-5 style CNN (LeCun et al. 1998) with ReLU and max pooling, for MNIST (28x28) and 8x8 digits.

conv1 keeps the size (as LeNet-5 fed padded 28x28 digits); conv2 is "valid" from 12x12 up and "same" below, so
8x8 digits work (the smallest image is 4x4). 61,706 parameters at 28x28, 21,386 at 8x8 (10 classes).
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import Conv2d, Linear, MaxPool2d, ReLU

from .common import finish, new_network

MIN_IMAGE_SIZE = 4


def lenet(batch: int = 64, image_size: int = 28, num_classes: int = 10, in_channels: int = 1,
          dtype="float32", variant: str | None = None):
    """LeNet-5 style network; `variant` must be None."""
    if variant is not None:
        raise OptionError(f"lenet: unknown variant {variant!r} (lenet has none)")
    net, x, y = new_network("lenet5", batch, in_channels, image_size, num_classes, dtype)
    if image_size < MIN_IMAGE_SIZE:
        raise OptionError(f"lenet: image_size must be at least {MIN_IMAGE_SIZE} (two 2x2 poolings), "
                          f"got {image_size}")
    pad2 = 0 if image_size >= 12 else 2
    h = ReLU(name="relu1")(Conv2d(6, 5, padding=2, name="conv1")(x))
    h = MaxPool2d(2, name="pool1")(h)
    h = ReLU(name="relu2")(Conv2d(16, 5, padding=pad2, name="conv2")(h))
    h = MaxPool2d(2, name="pool2")(h)
    h = ReLU(name="relu3")(Linear(120, name="fc1")(h))
    h = ReLU(name="relu4")(Linear(84, name="fc2")(h))
    return finish(net, Linear(num_classes, name="fc3")(h), y)
