// minidl CUDA kernels: element-wise ops, dropout, channel concat, LRN.
//
// Loaded at run time with cupy.RawModule (NVRTC), so this file is device code
// only: no host code, no #include (NVRTC has no standard headers), every entry
// point is `extern "C" __global__` so its symbol is not C++-mangled.
//
// Conventions shared by every minidl kernel file:
//   * data is float32, labels are int64 (`long long`); a kernel with half
//     forms takes bf16 or fp16 storage in its `_bf16` / `_f16` entry points,
//     written once in the HALF block that closes its file;
//   * outputs come first in the argument list, then inputs, then sizes, then
//     scalar hyper-parameters;
//   * sizes are `long long` and every kernel uses a grid-stride loop, so any
//     grid (see minidl/backend/cuda/kernel_specs.py: launch_config) covers any n;
//   * n == 0 is legal and does nothing.
//
// The argument lists here are mirrored in minidl/backend/cuda/kernel_specs.py and
// tests/backend/test_kernels.py checks that they agree.

// Grid-stride loop over [0, n) with a 64-bit index.
// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce), then kernels/half_storage.cuh (bf16/f16 types, load, store).

// ---------------------------------------------------------------------------
// Basic element-wise ops
// ---------------------------------------------------------------------------

// out = a + b                                         (torch.add, same shapes)
// `out` may alias `a` or `b` (in-place add), hence no __restrict__.
template <typename T>
static __device__ void add_body(T* out, const T* a, const T* b, long long n)
{
    GRID_STRIDE_LOOP(i, n) { store(out, i, load(a, i) + load(b, i)); }
}

extern "C" __global__ void add_forward(float* out, const float* a,
                                       const float* b, long long n)
{
    add_body(out, a, b, n);
}

// out = x0 + x1 + ... + x(k-1), 2 <= k <= 8     (an add of up to 8 inputs)
// Summed left to right in float32, as chained float32 adds would, and stored
// once: an add of half inputs rounds once, as the CPU. Slots from k on are
// not read. `out` may alias an input.
template <typename T>
static __device__ void add_many_body(T* out, const T* x0, const T* x1,
                                     const T* x2, const T* x3, const T* x4,
                                     const T* x5, const T* x6, const T* x7,
                                     int k, long long n)
{
    const T* xs[8] = {x0, x1, x2, x3, x4, x5, x6, x7};
    GRID_STRIDE_LOOP(i, n) {
        float s = load(xs[0], i) + load(xs[1], i);
        for (int j = 2; j < k; ++j) s += load(xs[j], i);
        store(out, i, s);
    }
}

extern "C" __global__ void add_many(float* out,
                                    const float* x0, const float* x1, const float* x2,
                                    const float* x3, const float* x4, const float* x5,
                                    const float* x6, const float* x7, int k, long long n)
{
    add_many_body(out, x0, x1, x2, x3, x4, x5, x6, x7, k, n);
}

// dst += src                     (Tensor.add_, used for gradient accumulation)
template <typename T>
static __device__ void accumulate_body(T* __restrict__ dst,
                                       const T* __restrict__ src, long long n)
{
    GRID_STRIDE_LOOP(i, n) { store(dst, i, load(dst, i) + load(src, i)); }
}

extern "C" __global__ void accumulate(float* __restrict__ dst,
                                      const float* __restrict__ src,
                                      long long n)
{
    accumulate_body(dst, src, n);
}

// out = x converted between float32 and a half storage: rounded into the
// half (a weight's half copy refreshed from its float32 master, as the
// CPU's narrow_into), or widened exactly from it (an add of more than two
// half inputs sums in float32 and rounds once, as the CPU).
template <typename TO, typename FROM>
static __device__ void convert_body(TO* __restrict__ out, const FROM* __restrict__ x,
                                    long long n)
{
    GRID_STRIDE_LOOP(i, n) { store(out, i, load(x, i)); }
}

// out = x * scale                                       (torch.mul by scalar)
// `out` may alias `x` (in-place scaling): one thread reads then writes the
// same element, so the pointers are deliberately not __restrict__.
extern "C" __global__ void scale_copy(float* out, const float* x, long long n,
                                      float scale)
{
    GRID_STRIDE_LOOP(i, n) { out[i] = x[i] * scale; }
}

// y = max(x, 0)                                                 (torch.relu)
// Written as `x <= 0 ? 0 : x` so a NaN input stays NaN, like torch.relu.
// `y` may alias `x` (in-place ReLU).
template <typename T>
static __device__ void relu_forward_body(T* y, const T* x, long long n)
{
    GRID_STRIDE_LOOP(i, n)
    {
        const float v = load(x, i);
        store(y, i, (v <= 0.0f) ? 0.0f : v);
    }
}

extern "C" __global__ void relu_forward(float* y, const float* x, long long n)
{
    relu_forward_body(y, x, n);
}

// dx = dy where y > 0, else 0       (torch threshold_backward(dy, y, 0), the
// autograd formula of relu, which is expressed on the OUTPUT y). Like PyTorch
// it is written `y <= 0 ? 0 : dy`, so a NaN y passes dy through.
// `dx` may alias `dy`.
template <typename T>
static __device__ void relu_backward_body(T* dx, const T* __restrict__ y,
                                          const T* dy, long long n)
{
    GRID_STRIDE_LOOP(i, n) { store(dx, i, (load(y, i) <= 0.0f) ? 0.0f : load(dy, i)); }
}

extern "C" __global__ void relu_backward(float* dx, const float* __restrict__ y,
                                         const float* dy, long long n)
{
    relu_backward_body(dx, y, dy, n);
}

// ---------------------------------------------------------------------------
// Dropout with a counter-based RNG (torch.nn.functional.dropout, training)
//
// The keep mask is a pure function of (key, element index), so the backward
// pass replays it instead of storing it, and the numpy CPU backend computes
// the very same mask (minidl/backend/cuda/kernel_specs.py: splitmix64,
// dropout_keep_mask). For element i (0-based, uint64 arithmetic mod 2^64):
//     z    = splitmix64(key + i)
//     keep = (z >> 40) >= threshold24        (top 24 bits of z vs threshold)
// with threshold24 = round(p * 2^24) (kernel_specs.dropout_threshold24), so
// P(drop) = threshold24 / 2^24 ~= p; p = 0 keeps everything, p = 1 (threshold
// 2^24) drops everything. Kept elements are multiplied by scale = 1 / (1 - p)
// (the host passes any finite value when p = 1: nothing is kept).
// ---------------------------------------------------------------------------

// SplitMix64 finaliser (Steele, Lea & Flood 2014), all arithmetic wrapping.
static __device__ __forceinline__ unsigned long long
splitmix64(unsigned long long x)
{
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ bool
dropout_keep(unsigned long long key, long long i, unsigned int threshold24)
{
    const unsigned long long z = splitmix64(key + (unsigned long long)i);
    return (unsigned int)(z >> 40) >= threshold24;
}

// out = keep(i) ? x * scale : 0, the one loop every dropout entry point runs
// (so the graph variants below give the same bits as the plain ones).
template <typename T>
static __device__ __forceinline__ void
dropout_apply(T* out, const T* x, long long n, unsigned long long key,
              unsigned int threshold24, float scale)
{
    GRID_STRIDE_LOOP(i, n)
    {
        store(out, i, dropout_keep(key, i, threshold24) ? load(x, i) * scale : 0.0f);
    }
}

// out = keep(i) ? x * scale : 0.   `out` may alias `x`.
extern "C" __global__ void dropout_forward(float* out, const float* x,
        long long n, unsigned long long key, unsigned int threshold24, float scale)
{
    dropout_apply(out, x, n, key, threshold24, scale);
}

// dx = keep(i) ? dy * scale : 0 (same key/threshold as the forward pass).
// `dx` may alias `dy`.
extern "C" __global__ void dropout_backward(float* dx, const float* dy,
        long long n, unsigned long long key, unsigned int threshold24, float scale)
{
    dropout_apply(dx, dy, n, key, threshold24, scale);
}

// The same with the key read from device memory (`key[0]`): what a CUDA
// graph replays (minidl/runtime/capture.py), since the key changes at every step and a
// launch argument is fixed at capture. Same mask for the same key.
extern "C" __global__ void dropout_forward_dev(float* out, const float* x,
        long long n, const unsigned long long* key, unsigned int threshold24, float scale)
{
    dropout_apply(out, x, n, key[0], threshold24, scale);
}

extern "C" __global__ void dropout_backward_dev(float* dx, const float* dy,
        long long n, const unsigned long long* key, unsigned int threshold24, float scale)
{
    dropout_apply(dx, dy, n, key[0], threshold24, scale);
}

// ---------------------------------------------------------------------------
// The divergence guard on the device (minidl/runtime/capture.py): a CUDA graph cannot
// stop for the host to look at a gradient, so each guarded tensor is checked
// here and the first non-finite one (in launch order, i.e. the host guard's
// order) leaves its `code` in `flag[0]`; the update kernels' graph variants
// skip while it is set, and the host reads it after the step.
// ---------------------------------------------------------------------------
extern "C" __global__ void nonfinite_flag(int* flag, const float* x,
                                          long long n, int code)
{
    GRID_STRIDE_LOOP(i, n)
    {
        if (!isfinite(x[i])) {
            atomicCAS(flag, 0, code);
        }
    }
}

// ---------------------------------------------------------------------------
// Channel concatenation (torch.cat(dim=1)), one input at a time.
//
// x is (N, Ci, *spatial) and out is (N, Ctotal, *spatial), both contiguous;
// `inner` = prod(spatial) (H*W for NCHW, 1 for (N, C) features). The input
// occupies channels [c0, c0 + Ci) of the output.
// ---------------------------------------------------------------------------

// out[n, c0 + c, s] = x[n, c, s]          (the host calls it once per input)
template <typename T>
static __device__ void concat_copy_forward_body(T* __restrict__ out, const T* __restrict__ x,
                                                long long N, long long Ci, long long inner,
                                                long long Ctotal, long long c0)
{
    const long long per_sample = Ci * inner;
    GRID_STRIDE_LOOP(i, N * per_sample)
    {
        const long long n = i / per_sample;
        const long long r = i - n * per_sample;  // = c * inner + s
        out[(n * Ctotal + c0) * inner + r] = x[i];
    }
}

// dx[n, c, s] = dout[n, c0 + c, s]      (slice of the gradient; overwrites dx)
template <typename T>
static __device__ void concat_copy_backward_body(T* __restrict__ dx, const T* __restrict__ dout,
                                                 long long N, long long Ci, long long inner,
                                                 long long Ctotal, long long c0)
{
    const long long per_sample = Ci * inner;
    GRID_STRIDE_LOOP(i, N * per_sample)
    {
        const long long n = i / per_sample;
        const long long r = i - n * per_sample;
        dx[i] = dout[(n * Ctotal + c0) * inner + r];
    }
}

// The concat copies move values unchanged (half values as their bits).
extern "C" __global__ void concat_copy_forward(float* __restrict__ out,
        const float* __restrict__ x, long long N, long long Ci, long long inner, long long Ctotal,
        long long c0)
{
    concat_copy_forward_body(out, x, N, Ci, inner, Ctotal, c0);
}

extern "C" __global__ void concat_copy_backward(float* __restrict__ dx,
        const float* __restrict__ dout, long long N, long long Ci, long long inner, long long Ctotal,
        long long c0)
{
    concat_copy_backward_body(dx, dout, N, Ci, inner, Ctotal, c0);
}

// ---------------------------------------------------------------------------
// Local response normalisation across channels (torch.nn.LocalResponseNorm).
//
// x, y are (N, C, *spatial) contiguous, inner = prod(spatial). PyTorch pads
// the channel axis with size/2 zeros in front and (size-1)/2 behind and
// average-pools with a window of `size` (always dividing by `size`):
//     S[c]   = sum_{j = c - size/2}^{c + (size-1)/2} x[j]^2   (x[j] = 0 outside)
//     div[c] = (k + alpha * S[c] / size) ^ beta
//     y[c]   = x[c] / div[c]
// ---------------------------------------------------------------------------

// S[c] / size for the channel window of channel c at (n, s); `base` points at
// x[n, 0, s].
template <typename T>
static __device__ __forceinline__ float
lrn_window_mean_sq(const T* __restrict__ base, long long c, long long C,
                   long long inner, int size)
{
    long long lo = c - size / 2;
    long long hi = c + (size - 1) / 2;  // inclusive
    if (lo < 0) lo = 0;
    if (hi > C - 1) hi = C - 1;
    float s = 0.0f;
    for (long long j = lo; j <= hi; ++j) {
        const float v = load(base, j * inner);
        s += v * v;
    }
    return s / (float)size;
}

// y = x / (k + alpha * mean_window(x^2)) ^ beta
template <typename T>
static __device__ void lrn_forward_body(T* __restrict__ y, const T* __restrict__ x,
                                        long long N, long long C, long long inner,
                                        int size, float alpha, float beta, float k)
{
    GRID_STRIDE_LOOP(i, N * C * inner)
    {
        const long long s = i % inner;
        const long long c = (i / inner) % C;
        const long long n = i / (C * inner);
        const T* base = x + n * C * inner + s;
        const float div =
            powf(lrn_window_mean_sq(base, c, C, inner, size) * alpha + k, beta);
        store(y, i, load(x, i) / div);
    }
}

extern "C" __global__ void lrn_forward(float* __restrict__ y,
        const float* __restrict__ x, long long N, long long C, long long inner, int size,
        float alpha, float beta, float k)
{
    lrn_forward_body(y, x, N, C, inner, size, alpha, beta, k);
}

// Gradient of LocalResponseNorm (autograd of the PyTorch formula above).
// With d[c] = k + alpha/size * S[c] and y[c] = x[c] * d[c]^-beta:
//     dx[i] = dy[i] * d[i]^-beta
//             - 2 * alpha * beta / size * x[i] * sum_{c : i in win(c)} dy[c] * y[c] / d[c]
// where i in win(c)  <=>  i - (size-1)/2 <= c <= i + size/2. d is recomputed
// from x (O(size^2) reads per element, cached); y is the forward output.
template <typename T>
static __device__ void lrn_backward_body(T* __restrict__ dx, const T* __restrict__ x,
                                         const T* __restrict__ y, const T* __restrict__ dy,
                                         long long N, long long C, long long inner,
                                         int size, float alpha, float beta, float k)
{
    GRID_STRIDE_LOOP(i, N * C * inner)
    {
        const long long s = i % inner;
        const long long c = (i / inner) % C;
        const long long n = i / (C * inner);
        const long long plane = n * C * inner + s;  // offset of [n, 0, s]
        const T* xbase = x + plane;

        const float d_self = lrn_window_mean_sq(xbase, c, C, inner, size) * alpha + k;
        float grad = load(dy, i) * powf(d_self, -beta);

        long long lo = c - (size - 1) / 2;
        long long hi = c + size / 2;  // inclusive
        if (lo < 0) lo = 0;
        if (hi > C - 1) hi = C - 1;
        float acc = 0.0f;
        for (long long cc = lo; cc <= hi; ++cc) {
            const float d = lrn_window_mean_sq(xbase, cc, C, inner, size) * alpha + k;
            const long long o = plane + cc * inner;
            acc += load(dy, o) * load(y, o) / d;
        }
        grad -= 2.0f * alpha * beta / (float)size * load(x, i) * acc;
        store(dx, i, grad);
    }
}

extern "C" __global__ void lrn_backward(float* __restrict__ dx,
        const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ dy,
        long long N, long long C, long long inner, int size, float alpha, float beta, float k)
{
    lrn_backward_body(dx, x, y, dy, N, C, inner, size, alpha, beta, k);
}

// ---------------------------------------------------------------------------
// Half entry points, written once for both halves: HALF(name) is <name>_bf16
// or <name>_f16 and half_t that storage, as kernel_specs.module_source
// defines them before the text of a bf16 or fp16 run. A float32 run's text
// leaves HALF undefined, so it compiles none of them.
// ---------------------------------------------------------------------------
#ifdef HALF

extern "C" __global__ void HALF(add_forward)(half_t* out, const half_t* a, const half_t* b, long long n)
{
    add_body(out, a, b, n);
}

extern "C" __global__ void HALF(add_many)(half_t* out, const half_t* x0, const half_t* x1, const half_t* x2,
        const half_t* x3, const half_t* x4, const half_t* x5, const half_t* x6, const half_t* x7, int k,
        long long n)
{
    add_many_body(out, x0, x1, x2, x3, x4, x5, x6, x7, k, n);
}

extern "C" __global__ void HALF(accumulate)(half_t* __restrict__ dst, const half_t* __restrict__ src, long long n)
{
    accumulate_body(dst, src, n);
}

extern "C" __global__ void HALF(round_copy)(half_t* __restrict__ out, const float* __restrict__ x, long long n)
{
    convert_body(out, x, n);
}

extern "C" __global__ void HALF(widen_copy)(float* __restrict__ out, const half_t* __restrict__ x, long long n)
{
    convert_body(out, x, n);
}

extern "C" __global__ void HALF(relu_forward)(half_t* y, const half_t* x, long long n)
{
    relu_forward_body(y, x, n);
}

extern "C" __global__ void HALF(relu_backward)(half_t* dx, const half_t* __restrict__ y, const half_t* dy,
        long long n)
{
    relu_backward_body(dx, y, dy, n);
}

extern "C" __global__ void HALF(dropout_forward)(half_t* out, const half_t* x, long long n, unsigned long long key,
        unsigned int threshold24, float scale)
{
    dropout_apply(out, x, n, key, threshold24, scale);
}

extern "C" __global__ void HALF(dropout_backward)(half_t* dx, const half_t* dy, long long n, unsigned long long key,
        unsigned int threshold24, float scale)
{
    dropout_apply(dx, dy, n, key, threshold24, scale);
}

extern "C" __global__ void HALF(dropout_forward_dev)(half_t* out, const half_t* x, long long n,
        const unsigned long long* key, unsigned int threshold24, float scale)
{
    dropout_apply(out, x, n, key[0], threshold24, scale);
}

extern "C" __global__ void HALF(dropout_backward_dev)(half_t* dx, const half_t* dy, long long n,
        const unsigned long long* key, unsigned int threshold24, float scale)
{
    dropout_apply(dx, dy, n, key[0], threshold24, scale);
}

extern "C" __global__ void HALF(concat_copy_forward)(half_t* __restrict__ out, const half_t* __restrict__ x,
        long long N, long long Ci, long long inner, long long Ctotal, long long c0)
{
    concat_copy_forward_body(out, x, N, Ci, inner, Ctotal, c0);
}

extern "C" __global__ void HALF(concat_copy_backward)(half_t* __restrict__ dx, const half_t* __restrict__ dout,
        long long N, long long Ci, long long inner, long long Ctotal, long long c0)
{
    concat_copy_backward_body(dx, dout, N, Ci, inner, Ctotal, c0);
}

extern "C" __global__ void HALF(lrn_forward)(half_t* __restrict__ y, const half_t* __restrict__ x, long long N,
        long long C, long long inner, int size, float alpha, float beta, float k)
{
    lrn_forward_body(y, x, N, C, inner, size, alpha, beta, k);
}

extern "C" __global__ void HALF(lrn_backward)(half_t* __restrict__ dx, const half_t* __restrict__ x,
        const half_t* __restrict__ y, const half_t* __restrict__ dy, long long N, long long C, long long inner,
        int size, float alpha, float beta, float k)
{
    lrn_backward_body(dx, x, y, dy, N, C, inner, size, alpha, beta, k);
}

#endif  // HALF
