"""Layers, one module per family. Each declares shapes, parameters, FLOPs and what its backward needs."""
from .activation import ReLU
from .base import Layer, LayerContext, ParamSpec, WorkspaceOption
from .batchnorm import BatchNorm2d
from .conv import Conv2d
from .dropout import Dropout
from .join import Add, Concat
from .linear import Flatten, Linear
from .loss import SoftmaxCrossEntropy
from .lrn import LRN
from .pool import AvgPool2d, GlobalAvgPool, MaxPool2d

__all__ = [
    "Add", "AvgPool2d", "BatchNorm2d", "Concat", "Conv2d", "Dropout", "Flatten", "GlobalAvgPool", "LRN", "Layer",
    "LayerContext", "Linear", "MaxPool2d", "ParamSpec", "ReLU", "SoftmaxCrossEntropy", "WorkspaceOption",
]
