"""Data for training: images as `Dataset`s, text as `SequenceDataset`s, batched by `BatchIterator`; ``--data SPEC``
read by `load_data`."""
from .augment import Augment, parse_augment
from .dataset import BatchIterator, Dataset, from_arrays
from .load import data_paths, from_files, load_data
from .sets import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD, digits, load_cifar10, load_mnist, synthetic
from .text import BYTE_VOCAB, SequenceDataset

__all__ = ["Augment", "BatchIterator", "BYTE_VOCAB", "CIFAR10_MEAN", "CIFAR10_STD", "Dataset", "MNIST_MEAN",
           "MNIST_STD", "SequenceDataset", "data_paths", "digits", "from_arrays", "from_files", "load_cifar10",
           "load_data", "load_mnist", "parse_augment", "synthetic"]
