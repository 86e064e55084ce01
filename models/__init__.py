"""The model zoo: builders returning a built `minidl.Network` with its loss set.

Every image builder takes (depth where it has one), batch, image_size, num_classes, in_channels, dtype, variant;
the inputs are named "data" (N, C, H, W) and "label" (N,) int64, the loss "loss". The sequence builders (`gpt2`,
`bert`) take size, layers, heads, width, seq, batch, vocab; their inputs are "tokens" and "targets" (B, T) int64.
`build_model(name, ...)` picks a registered model by name with per-model defaults (see `MODELS`).

    from minidl.models import resnet, build_model
    net = resnet(depth=2500, batch=16)          # SuperNeurons' ResNet-2500 (2498 weighted layers)
    net = build_model("vgg16", batch=8)
"""
from .alexnet import alexnet
from .bert import bert
from .common import weighted_layers
from .densenet import densenet
from .gpt2 import gpt2
from .inception_v4 import inception_v4
from .lenet import lenet
from .registry import (
    MODELS,
    SEQUENCE_OPTIONS,
    ModelSpec,
    build_model,
    canonical_model,
    describe_models,
    is_sequence_model,
    model_names,
    model_objective,
)
from .resnet import resnet
from .vgg import vgg

__all__ = ["MODELS", "SEQUENCE_OPTIONS", "ModelSpec", "alexnet", "bert", "build_model", "canonical_model", "densenet",
           "describe_models", "gpt2", "inception_v4", "is_sequence_model", "lenet", "model_names", "model_objective",
           "resnet", "vgg", "weighted_layers"]
