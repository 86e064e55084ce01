"""Layers, one module per family. Each declares shapes, parameters, FLOPs and what its backward needs."""
from .activation import GELU, ReLU, Softmax
from .attention import CausalSelfAttention, SelfAttention
from .base import Layer, LayerContext, ParamSpec, WorkspaceOption
from .batchnorm import BatchNorm2d
from .conv import Conv2d
from .dropout import Dropout
from .embedding import Embedding, PositionEmbedding
from .join import Add, Concat
from .layernorm import LayerNorm
from .linear import Flatten, Linear, MatMul
from .loss import IGNORE_INDEX, SoftmaxCrossEntropy
from .lrn import LRN
from .pooling import AvgPool2d, GlobalAvgPool, MaxPool2d

__all__ = [
    "Add", "AvgPool2d", "BatchNorm2d", "CausalSelfAttention", "Concat", "Conv2d", "Dropout", "Embedding", "Flatten",
    "GELU", "GlobalAvgPool", "IGNORE_INDEX", "LRN", "Layer", "LayerContext", "LayerNorm", "Linear", "MatMul",
    "MaxPool2d", "ParamSpec",
    "PositionEmbedding", "ReLU", "SelfAttention", "Softmax", "SoftmaxCrossEntropy", "WorkspaceOption",
]
