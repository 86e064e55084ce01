"""An error-bounded lossy compressor for float32/float64 arrays, SZ family (cuSZ's dual quantization).

Guarantee: |x - y| <= eb on every finite element; NaN, Inf and elements the bound fails for in floating point come
back bit for bit; zeros stay zeros and no sign flips (-0.0 included); deterministic; at most raw + `HEADER_BYTES`.
1. Quantize: p = sign(x) ceil(|x| / 2eb), decoded at sign(p)(2|p| - 1)eb; the bound is verified in float64 on the
   decoded values, and failures are outliers stored verbatim with p = 0.
2. Predict: code = p[i] - p[i-1] (exact integers, so parallel), restarting at a stored anchor every `BLOCK`.
3. Encode: `BLOCK`-bit planes of the zigzagged codes, as many as the widest needs; or canonical Huffman over the
   whole array (CPU), which beat the blocks and Zstandard on ResNet-20 (benchmarks/results/compression.json).
"""

import struct

import numpy as np

from ..core.errors import MinidlError

BLOCK = 256
"""Codes per fixed-length block (cuSZ's chunk; one 256-thread block on the GPU)."""

P_MAX = 1 << 40
"""Largest bin index |p| (2|p| - 1 stays exact in float64; zigzagged codes fit 42 bits); beyond it, an outlier."""

_MAGIC = b"MSZ1"
_HEAD = struct.Struct("<4sBBBBdQQQQ")   # magic, version, dtype, mode, anchor width, eb, n, outliers, body, total
HEADER_BYTES = _HEAD.size
_VERSION = 1
_DTYPES = {1: np.dtype(np.float32), 2: np.dtype(np.float64)}
_DTYPE_CODE = {v: k for k, v in _DTYPES.items()}
_MODE_RAW, _MODE_SZ, _MODE_SZ_HUFF = 0, 1, 3
ENTROPY = ("none", "huffman")
"""Encodings after prediction: fixed-length blocks (the GPU kernels' layout) or Huffman."""

HUFF_SYMBOLS = 32768
"""Lorenzo codes below this are Huffman symbols; larger ones are escaped, their value kept in 8 bytes."""


class CodecError(MinidlError, ValueError):
    """A codec was given something it cannot encode (dtype, bound) or a stream that is not its own."""


def _check(x: np.ndarray, eb: float) -> None:
    if np.dtype(x.dtype) not in _DTYPE_CODE:
        raise CodecError(f"sz.compress: dtype {x.dtype} is not supported (float32 or float64)")
    if not (isinstance(eb, (int, float, np.floating)) and np.isfinite(eb) and eb > 0):
        raise CodecError(f"sz.compress: the error bound must be a finite number > 0, got {eb!r}")


def dequantize(p: np.ndarray, eb: float, dtype) -> np.ndarray:
    """Bin indices -> values as the decoder and the CUDA kernel compute them: float64, then one rounding."""
    mag = 2.0 * np.abs(p).astype(np.float64) - 1.0
    val = np.where(p == 0, 0.0, np.copysign(mag * float(eb), p.astype(np.float64)))
    return val.astype(dtype)


def quantize(x: np.ndarray, eb: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin index per element, outliers set to 0; outlier indices) for a flat array."""
    xf = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.abs(xf) / (2.0 * float(eb))
        ok = np.isfinite(a) & (a <= P_MAX)
        p = np.where(ok, np.ceil(np.where(ok, a, 0.0)), 0.0).astype(np.int64)
        p[(p == 0) & (xf != 0) & ok] = 1    # |x| / 2eb underflowed to 0: the first bin keeps the sign
        p = np.where(xf < 0, -p, p)
        err = np.abs(xf - dequantize(p, eb, x.dtype).astype(np.float64))
    bad = ~(ok & (err <= float(eb))) | ((xf == 0) & np.signbit(xf))   # -0.0: bin 0 would decode as +0.0
    p[bad] = 0
    return p, np.flatnonzero(bad)


def _bit_length(m: np.ndarray) -> np.ndarray:
    w = np.zeros(m.shape, np.uint8)
    for b in range(64):
        nz = (m >> np.uint64(b)) != 0
        if not nz.any():
            break
        w += nz.astype(np.uint8)
    return w


def _zigzag(d: np.ndarray) -> np.ndarray:
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return (u >> np.uint64(1)).astype(np.int64) ^ -(u & np.uint64(1)).astype(np.int64)


def _pack_planes(codes: np.ndarray, w: int) -> np.ndarray:
    """(k, BLOCK) uint64 codes -> (k, w * BLOCK // 8) bytes, bit-plane by bit-plane."""
    k = codes.shape[0]
    out = np.empty((k, w, BLOCK // 8), np.uint8)
    for j in range(w):
        plane = ((codes >> np.uint64(j)) & np.uint64(1)).astype(np.uint8)
        out[:, j, :] = np.packbits(plane, axis=1, bitorder="little")
    return out.reshape(k, w * BLOCK // 8)


def _unpack_planes(raw: np.ndarray, w: int) -> np.ndarray:
    k = raw.shape[0]
    planes = raw.reshape(k, w, BLOCK // 8)
    codes = np.zeros((k, BLOCK), np.uint64)
    for j in range(w):
        bits = np.unpackbits(planes[:, j, :], axis=1, bitorder="little").astype(np.uint64)
        codes |= bits << np.uint64(j)
    return codes


def _encode_blocks(p: np.ndarray) -> tuple[bytes, int]:
    """Bin indices -> (anchors + widths + planes, anchor width)."""
    nb = -(-p.size // BLOCK)
    P = np.zeros(nb * BLOCK, np.int64)
    P[:p.size] = p
    P = P.reshape(nb, BLOCK)
    anchors = P[:, 0].copy()
    d = np.zeros_like(P)
    d[:, 1:] = np.diff(P, axis=1)
    u = _zigzag(d)
    widths = _bit_length(u.max(axis=1))
    ua = _zigzag(anchors)
    aw = int(_bit_length(ua.max(keepdims=True))[0]) if nb else 0
    apad = -(-nb // BLOCK) * BLOCK
    ablk = np.zeros(apad, np.uint64)
    ablk[:nb] = ua
    anchor_bytes = _pack_planes(ablk.reshape(-1, BLOCK), aw).tobytes() if aw else b""
    sizes = widths.astype(np.int64) * (BLOCK // 8)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    body = np.empty(int(sizes.sum()), np.uint8)
    for w in np.unique(widths):
        if w == 0:
            continue
        sel = np.flatnonzero(widths == w)
        packed = _pack_planes(u[sel], int(w))
        body[(starts[sel][:, None] + np.arange(packed.shape[1])).ravel()] = packed.ravel()
    return anchor_bytes + widths.tobytes() + body.tobytes(), aw


def _decode_blocks(buf: memoryview, n: int, aw: int) -> np.ndarray:
    nb = -(-n // BLOCK)
    pos = 0
    if aw:
        na = -(-nb // BLOCK)
        raw = np.frombuffer(buf, np.uint8, na * aw * BLOCK // 8, pos).reshape(na, -1)
        anchors = _unzigzag(_unpack_planes(raw, aw).ravel()[:nb])
        pos += raw.size
    else:
        anchors = np.zeros(nb, np.int64)
    widths = np.frombuffer(buf, np.uint8, nb, pos)
    pos += nb
    sizes = widths.astype(np.int64) * (BLOCK // 8)
    starts = pos + np.concatenate(([0], np.cumsum(sizes)[:-1]))
    body = np.frombuffer(buf, np.uint8)
    u = np.zeros((nb, BLOCK), np.uint64)
    for w in np.unique(widths):
        if w == 0:
            continue
        sel = np.flatnonzero(widths == w)
        raw = body[(starts[sel][:, None] + np.arange(int(w) * BLOCK // 8)).ravel()].reshape(sel.size, -1)
        u[sel] = _unpack_planes(raw, int(w))
    d = _unzigzag(u)
    d[:, 0] = 0
    return (anchors[:, None] + np.cumsum(d, axis=1)).ravel()[:n]


def _jit():
    """The compiled kernels, imported on first use: planning never pays numba's import."""
    from . import sz_jit

    return sz_jit


def huffman_pack(s: np.ndarray, esc: np.ndarray, freq: np.ndarray) -> bytes:
    """Symbols, escaped codes and counts -> header (u32 used, u64 escaped, u64 bit bytes), used symbols (u16),
    their code lengths (u8), escaped codes (i64), bits (most significant first)."""
    k = _jit()
    lens = k.code_lengths(freq, k.HUFF_MAX_LEN)
    used = np.flatnonzero(lens)
    bits = k.huff_encode(s, k.canonical_codes(lens), lens, int((freq * lens).sum()))
    return (struct.pack("<IQQ", used.size, esc.size, bits.size) + used.astype("<u2").tobytes()
            + lens[used].astype(np.uint8).tobytes() + esc.astype("<i8").tobytes() + bits.tobytes())


def huffman_unpack(body, pos: int = 0) -> tuple:
    """`huffman_pack`'s layout at `pos` -> `sz_jit.huff_decode`'s arguments and the position after the stream."""
    k = _jit()
    nused, nesc, nbytes = struct.unpack_from("<IQQ", body, pos)
    pos += struct.calcsize("<IQQ")
    syms = np.frombuffer(body, "<u2", nused, pos).astype(np.int64)
    pos += 2 * nused
    lens = np.frombuffer(body, np.uint8, nused, pos).astype(np.int64)
    pos += nused
    esc = np.frombuffer(body, "<i8", nesc, pos).astype(np.int64)
    pos += 8 * nesc
    bits = np.frombuffer(body, np.uint8, nbytes, pos)
    full = np.zeros(HUFF_SYMBOLS + 1, np.int64)
    full[syms] = lens
    return bits, syms, lens, k.canonical_codes(full)[syms], esc, pos + nbytes


def compress(x: np.ndarray, eb: float, entropy: str = "none") -> bytes:
    """Encode `x` (any shape, C order) within absolute bound `eb`; the shape is not stored (`decompress` takes it)."""
    x = np.asarray(x)
    _check(x, eb)
    if entropy not in ENTROPY:
        raise CodecError(f"sz.compress: entropy must be one of {', '.join(ENTROPY)}, got {entropy!r}")
    flat = np.ascontiguousarray(x).ravel()
    n = flat.size
    aw = 0
    if entropy == "huffman":
        s, esc, freq, out_idx = _jit().quantize_symbols(flat, float(eb), float(P_MAX), HUFF_SYMBOLS)
        body, mode = huffman_pack(s, esc, freq), _MODE_SZ_HUFF
    else:
        p, out_idx = _jit().quantize(flat, float(eb), float(P_MAX))
        (body, aw), mode = _encode_blocks(p), _MODE_SZ
    idx_dtype = np.uint32 if n <= 0xFFFFFFFF else np.uint64
    body += out_idx.astype(idx_dtype).tobytes() + flat[out_idx].tobytes()
    if len(body) >= flat.nbytes:   # never worse than raw
        body, mode, aw, out_idx = flat.tobytes(), _MODE_RAW, 0, out_idx[:0]
    head = _HEAD.pack(_MAGIC, _VERSION, _DTYPE_CODE[flat.dtype], mode, aw, float(eb), n, out_idx.size,
                      len(body), HEADER_BYTES + len(body))
    return head + body



def _parse_head(buf: memoryview):
    if len(buf) < HEADER_BYTES:
        raise CodecError(f"sz.decompress: {len(buf)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, ver, dt, mode, aw, eb, n, n_out, body_len, total = _HEAD.unpack_from(buf, 0)
    if (magic != _MAGIC or ver != _VERSION or dt not in _DTYPES or mode not in (_MODE_RAW, _MODE_SZ, _MODE_SZ_HUFF)
            or total > len(buf)):
        raise CodecError(f"sz.decompress: not an sz stream of this version (magic {magic!r}, version {ver}, "
                         f"{total} of {len(buf)} bytes)")
    return ver, dt, mode, aw, eb, n, n_out, body_len, total


def decompress(buf, shape=None) -> np.ndarray:
    """Decode a stream (bytes, or a uint8 block starting with one) to a new array."""
    mv = memoryview(np.ascontiguousarray(np.frombuffer(buf, np.uint8)) if not isinstance(buf, bytes) else buf)
    _, dt, mode, aw, eb, n, n_out, body_len, _ = _parse_head(mv)
    dtype = _DTYPES[dt]
    body = mv[HEADER_BYTES:HEADER_BYTES + body_len]
    if mode == _MODE_RAW:
        out = np.frombuffer(body, dtype, n).copy()
    else:
        if mode == _MODE_SZ_HUFF:
            bits, syms, lens, codes, esc, _ = huffman_unpack(body)
            out = _jit().huff_decode(bits, syms, lens, codes, HUFF_SYMBOLS, esc, n, float(eb), np.empty(n, dtype))
        else:
            out = dequantize(_decode_blocks(body, n, aw), eb, dtype)
        if n_out:
            idx_dtype = np.dtype(np.uint32 if n <= 0xFFFFFFFF else np.uint64)
            tail = n_out * (idx_dtype.itemsize + dtype.itemsize)
            start = len(body) - tail
            idx = np.frombuffer(body, idx_dtype, n_out, start)
            out[idx] = np.frombuffer(body, dtype, n_out, start + n_out * idx_dtype.itemsize)
    return out.reshape(shape) if shape is not None else out
