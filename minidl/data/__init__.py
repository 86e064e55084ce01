"""Data for training: image sets and a user's files as `Dataset`s, byte-level text as `SequenceDataset`s, the
batches of either gathered by `BatchIterator`, and ``--data SPEC`` parsed by `load_data`.

    dataset  the Dataset and BatchIterator every source produces and the session consumes
    sets     synthetic, the shipped digits, CIFAR-10 and MNIST
    files    a user's arrays (.npz, .npy) and image folders, read and checked as stored
    text     byte-level text (Python's own sources, a user's file) in sequences
    augment  crops and flips of training batches, drawn from a batch's place in the data order
    load     --data SPEC -> (train, held-out)
"""
from .augment import Augment, parse_augment
from .dataset import BatchIterator, Dataset, from_arrays
from .load import data_paths, from_files, load_data
from .sets import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD, digits, load_cifar10, load_mnist, synthetic
from .text import BYTE_VOCAB, SequenceDataset

__all__ = ["Augment", "BatchIterator", "BYTE_VOCAB", "CIFAR10_MEAN", "CIFAR10_STD", "Dataset", "MNIST_MEAN",
           "MNIST_STD", "SequenceDataset", "data_paths", "digits", "from_arrays", "from_files", "load_cifar10",
           "load_data", "load_mnist", "parse_augment", "synthetic"]
