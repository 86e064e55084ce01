"""The model zoo: builders of a built `minidl.Network` with its loss "loss"; image inputs "data" (N, C, H, W) and
"label" (N,), sequence inputs "tokens" and "targets" (B, T). `build_model(name, ...)` picks one from `MODELS`."""
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
