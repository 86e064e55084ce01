"""LeNet-5 style CNN (LeCun et al. 1998) with ReLU and max pooling, for MNIST (28x28) and 8x8 digits.

The exact architecture (S = image_size, C = in_channels, K = num_classes; conv1 keeps the size, like LeNet-5
fed 28x28 digits padded to 32x32):

    name   layer                                     output (S=28)   output (S=8)
    conv1  Conv2d(6, 5, padding=2)  + relu1          6 x 28 x 28     6 x 8 x 8
    pool1  MaxPool2d(2)                              6 x 14 x 14     6 x 4 x 4
    conv2  Conv2d(16, 5, padding=p2) + relu2         16 x 10 x 10    16 x 4 x 4
    pool2  MaxPool2d(2)                              16 x 5 x 5      16 x 2 x 2
    fc1    Linear(120) + relu3                       120             120
    fc2    Linear(84)  + relu4                       84              84
    fc3    Linear(K)                                 K               K

p2 = 0 (LeNet-5's "valid" convolution) when S >= 12, so that conv2 leaves at least 2x2 for pool2; for smaller
inputs p2 = 2 ("same"), which is what makes 8x8 digits work. The smallest image is 4x4 (then pool2 gives 1x1).
Parameters at 28x28, 1 channel, 10 classes: 61,706; at 8x8: 21,386 (fc1 sees 16*2*2 = 64 features).
"""
from __future__ import annotations

from minidl.core.errors import OptionError
from minidl.layers import Conv2d, Linear, MaxPool2d, ReLU

from .common import finish, new_network

MIN_IMAGE_SIZE = 4


def lenet(batch: int = 64, image_size: int = 28, num_classes: int = 10, in_channels: int = 1,
          dtype="float32", variant: str | None = None):
    """LeNet-5 style network (see the module docstring for the exact layers). `variant` must be None."""
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
