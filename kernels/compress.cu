// minidl CUDA kernels: the SZ-family error-bounded codec of minidl/codec/sz.py, on the device.
//
// Loaded with cupy.RawModule (NVRTC): device code only, no #include, every entry point `extern "C" __global__`
// (see elementwise.cu for the shared conventions). The stream layout is the CPU codec's, bit for bit, so a
// tensor compressed on one backend decodes on the other:
//
//   sz_quantize        one thread per element: bin index p (sign-keeping midpoint quantizer, step 2*eb) and an
//                      outlier flag (NaN/Inf, -0.0, |p| > 2^40, or float32 rounding past the bound), computed in double
//                      exactly as numpy does (IEEE division, ceil, one rounding to float).
//   sz_encode_blocks   one 256-thread block per block of 256 codes: Lorenzo difference inside the block (its
//                      first p is the anchor), zigzag, width w = bit length of the block's largest code, and w
//                      bit-planes written with __ballot_sync (plane j, word k = bit j of codes 32k..32k+31; the
//                      CPU's little-endian packbits gives the same words). Planes go to a fixed 64-plane slot per
//                      block; the host compacts them with the prefix sum of the widths (sz_gather_planes).
//   sz_decode_blocks   one 256-thread block per block: rebuild each code from its block's planes, unzigzag, a
//                      block-wide prefix sum from the anchor, dequantize.
//   sz_scatter_outliers  one thread per outlier: write its exact value back.
//
// Launch: the block kernels need blockDim.x == 256 (SZ_BLOCK) and grid-stride over blocks.

// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce).

#define SZ_BLOCK 256
#define SZ_WORDS 8            // 32-bit words per plane (SZ_BLOCK / 32)
#define SZ_MAX_PLANES 64
#define SZ_P_MAX 1099511627776.0   // 2^40

__device__ __forceinline__ float sz_dequant(long long p, double eb)
{
    if (p == 0) return 0.0f;
    const double mag = 2.0 * (double)(p < 0 ? -p : p) - 1.0;
    const double v = mag * eb;
    return (float)(p < 0 ? -v : v);
}

__device__ __forceinline__ unsigned long long sz_zigzag(long long d)
{
    return ((unsigned long long)d << 1) ^ (unsigned long long)(d >> 63);
}

__device__ __forceinline__ long long sz_unzigzag(unsigned long long u)
{
    return (long long)(u >> 1) ^ -(long long)(u & 1ull);
}

extern "C" __global__ void sz_quantize(long long* __restrict__ bins, unsigned char* __restrict__ outlier,
                                       const float* __restrict__ x, long long n, double eb)
{
    GRID_STRIDE_LOOP(i, n)
    {
        const double xf = (double)x[i];
        const double a = fabs(xf) / (2.0 * eb);
        const bool ok = isfinite(a) && a <= SZ_P_MAX;
        long long p = ok ? (long long)ceil(a) : 0;
        if (ok && p == 0 && xf != 0.0) p = 1;        // |x| / 2eb underflowed: keep the sign in the first bin
        if (xf < 0.0) p = -p;
        const double err = fabs(xf - (double)sz_dequant(p, eb));
        const bool bad = !(ok && err <= eb) || __float_as_uint(x[i]) == 0x80000000u;  // -0.0: bin 0 is +0.0
        bins[i] = bad ? 0 : p;
        outlier[i] = bad ? 1 : 0;
    }
}

extern "C" __global__ void sz_encode_blocks(unsigned int* __restrict__ planes, unsigned char* __restrict__ widths,
                                            long long* __restrict__ anchors, const long long* __restrict__ bins,
                                            long long n, long long nblocks)
{
    __shared__ unsigned long long warp_max[SZ_WORDS];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const long long i = b * SZ_BLOCK + t;
        const long long p = i < n ? bins[i] : 0;
        const long long prev = (t == 0) ? p : ((i - 1) < n ? bins[i - 1] : 0);
        const unsigned long long u = sz_zigzag(p - prev);
        unsigned long long m = u;
        for (int off = 16; off > 0; off >>= 1) {
            const unsigned long long o = __shfl_down_sync(0xffffffffu, m, off);
            m = o > m ? o : m;
        }
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        unsigned long long bm = 0;
        for (int k = 0; k < SZ_WORDS; ++k) bm = warp_max[k] > bm ? warp_max[k] : bm;
        const int w = bm ? 64 - __clzll((long long)bm) : 0;
        if (t == 0) {
            widths[b] = (unsigned char)w;
            anchors[b] = p;
        }
        for (int j = 0; j < w; ++j) {
            const unsigned int word = __ballot_sync(0xffffffffu, (unsigned int)((u >> j) & 1ull));
            if (lane == 0) planes[(b * SZ_MAX_PLANES + j) * SZ_WORDS + warp] = word;
        }
        __syncthreads();   // warp_max is reused by the next block of this grid-stride loop
    }
}

extern "C" __global__ void sz_gather_planes(unsigned int* __restrict__ body, const unsigned int* __restrict__ planes,
                                            const unsigned char* __restrict__ widths,
                                            const long long* __restrict__ starts, long long nblocks)
{
    // one thread per (block, plane word) of the fixed-slot layout; starts[b] = sum of widths before b, in planes
    GRID_STRIDE_LOOP(k, nblocks * SZ_MAX_PLANES * SZ_WORDS)
    {
        const long long b = k / (SZ_MAX_PLANES * SZ_WORDS);
        const long long r = k % (SZ_MAX_PLANES * SZ_WORDS);
        if (r / SZ_WORDS < widths[b]) body[starts[b] * SZ_WORDS + r] = planes[k];
    }
}

extern "C" __global__ void sz_decode_blocks(float* __restrict__ y, const unsigned int* __restrict__ body,
                                            const unsigned char* __restrict__ widths,
                                            const long long* __restrict__ starts,
                                            const long long* __restrict__ anchors, long long n, long long nblocks,
                                            double eb)
{
    __shared__ long long scan[SZ_BLOCK];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const int w = widths[b];
        const unsigned int* pl = body + starts[b] * SZ_WORDS;
        unsigned long long u = 0;
        for (int j = 0; j < w; ++j) u |= (unsigned long long)((pl[j * SZ_WORDS + warp] >> lane) & 1u) << j;
        scan[t] = (t == 0) ? 0 : sz_unzigzag(u);
        __syncthreads();
        for (int off = 1; off < SZ_BLOCK; off <<= 1) {     // Hillis-Steele inclusive prefix sum
            const long long v = t >= off ? scan[t - off] : 0;
            __syncthreads();
            scan[t] += v;
            __syncthreads();
        }
        const long long i = b * SZ_BLOCK + t;
        if (i < n) y[i] = sz_dequant(anchors[b] + scan[t], eb);
        __syncthreads();
    }
}

extern "C" __global__ void sz_scatter_outliers(float* __restrict__ y, const long long* __restrict__ idx,
                                               const float* __restrict__ vals, long long n_out)
{
    GRID_STRIDE_LOOP(k, n_out)
    {
        y[idx[k]] = vals[k];
    }
}
