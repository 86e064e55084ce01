"""A JPEG-ACT-style activation codec (Evans et al., ISCA 2020): the image-codec family COMET is compared against.

A comparator for `minidl reproduce comet`, not an option of the compress policy. Each plane (last two axes) is
scaled by its max |x| to [-127, 127], edge-padded to 8x8 tiles, DCT-II transformed, divided by the JPEG luminance
table scaled for `quality` (libjpeg's rule), rounded and Huffman-coded (`sz.huffman_pack`). No per-element bound:
a tile's error spreads over its 64 values and zeros do not stay zeros (reproduce stores sign-only tensors as a
1-bit mask for this codec). Deterministic.
"""
from __future__ import annotations

import struct

import numpy as np

from . import sz
from .sz import CodecError

TILE = 8
_MAGIC = b"MJA1"
_HEAD = struct.Struct("<4sBQII")   # magic, quality, planes, height, width
HEADER_BYTES = _HEAD.size

LUMA = np.array([
    [16, 11, 10, 16, 24, 40, 51, 61], [12, 12, 14, 19, 26, 58, 60, 55], [14, 13, 16, 24, 40, 57, 69, 56],
    [14, 17, 22, 29, 51, 87, 80, 62], [18, 22, 37, 56, 68, 109, 103, 77], [24, 35, 55, 64, 81, 104, 113, 92],
    [49, 64, 78, 87, 103, 121, 120, 101], [72, 92, 95, 98, 112, 100, 103, 99]], np.float64)
"""The JPEG standard's luminance quantization table (ITU T.81, Annex K)."""


def _dct_matrix() -> np.ndarray:
    k = np.arange(TILE)
    d = np.cos(np.pi * (2 * k[None, :] + 1) * k[:, None] / (2 * TILE)) * np.sqrt(2.0 / TILE)
    d[0] /= np.sqrt(2.0)
    return d


_D = _dct_matrix()


def table(quality: int) -> np.ndarray:
    """The quantization table for `quality` in 1..100 (libjpeg's scaling of `LUMA`)."""
    if not (isinstance(quality, (int, np.integer)) and 1 <= quality <= 100):
        raise CodecError(f"jpeg_act: quality must be an integer in 1..100, got {quality!r}")
    scale = 5000 / quality if quality < 50 else 200 - 2 * quality
    return np.maximum(np.floor((LUMA * scale + 50) / 100), 1.0)


def _planes(shape) -> tuple[int, int, int]:
    if len(shape) >= 2:
        h, w = int(shape[-2]), int(shape[-1])
        return int(np.prod(shape[:-2], dtype=np.int64)), h, w
    return 1, 1, int(np.prod(shape, dtype=np.int64))


def compress(x: np.ndarray, quality: int = 90) -> bytes:
    """Encode float array `x` (any shape; planes are its last two axes)."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise CodecError(f"jpeg_act.compress: dtype {x.dtype} is not supported (float32 or float64)")
    q = table(quality)
    p, h, w = _planes(x.shape)
    a = np.nan_to_num(x.astype(np.float64).reshape(p, h, w), nan=0.0, posinf=0.0, neginf=0.0)
    scale = np.abs(a).reshape(p, -1).max(axis=1, initial=0.0) / 127.0
    scale[scale == 0] = 1.0
    a = a / scale[:, None, None]
    hp, wp = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    a = np.pad(a, ((0, 0), (0, hp - h), (0, wp - w)), mode="edge") if a.size else np.zeros((p, hp, wp))
    t = a.reshape(p, hp // TILE, TILE, wp // TILE, TILE)
    coef = np.einsum("ij,pajbk,lk->pabil", _D, t, _D, optimize=True)
    ints = np.rint(coef / q).astype(np.int64).ravel()
    s, esc, freq = sz._jit().int_symbols(ints, sz.HUFF_SYMBOLS)
    return (_HEAD.pack(_MAGIC, quality, p, h, w) + scale.astype("<f4").tobytes()
            + sz.huffman_pack(s, esc, freq))


def decompress(buf: bytes, shape, dtype=np.float32) -> np.ndarray:
    """Decode a stream from `compress` to an array of `shape`."""
    magic, quality, p, h, w = _HEAD.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise CodecError(f"jpeg_act.decompress: not a jpeg_act stream (magic {magic!r})")
    scale = np.frombuffer(buf, "<f4", p, HEADER_BYTES).astype(np.float64)
    hp, wp = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    n = p * hp * wp
    bits, syms, lens, codes, esc, _ = sz.huffman_unpack(buf, HEADER_BYTES + 4 * p)
    ints = sz._jit().huff_decode_ints(bits, syms, lens, codes, sz.HUFF_SYMBOLS, esc, n)
    coef = ints.reshape(p, hp // TILE, wp // TILE, TILE, TILE) * table(quality)
    t = np.einsum("ij,pabil,lk->pajbk", _D, coef, _D, optimize=True)
    a = t.reshape(p, hp, wp)[:, :h, :w] * scale[:, None, None]
    return a.astype(dtype).reshape(shape)
