// minidl CUDA kernels: 2-D pooling on NCHW float32 tensors (bf16 / fp16 in the
// `_bf16` / `_f16` forms).
//
// Loaded with cupy.RawModule (NVRTC): device code only, no #include, every
// entry point `extern "C" __global__`. See elementwise.cu for the shared
// conventions (outputs first, `long long` sizes, grid-stride loops).
//
// Shapes: x is (N, C, H, W), y is (N, C, OH, OW), both contiguous. The host
// computes OH/OW (so ceil_mode is the host's choice), e.g. for max pooling
//     OH = floor((H + 2*ph - dh*(kh-1) - 1) / sh) + 1      (ceil for ceil_mode)
// Windows that hang over the padded border are clipped, as in PyTorch.

// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce), then kernels/half_storage.cuh (bf16/f16 types, load, store).

// ---------------------------------------------------------------------------
// Max pooling (torch.nn.functional.max_pool2d)
// ---------------------------------------------------------------------------

// Max and argmax of the window of output (oh, ow) in one (H, W) plane.
// Padding acts as -inf (padded positions are never selected). Exactly
// PyTorch's rule: the index starts at the first in-bounds position of the
// window and moves to a later element only if it is strictly greater or NaN;
// so the result is the FIRST maximum in row-major window order, and a NaN
// wins (the last NaN, as in PyTorch). Returns -1 (and -inf) for a window with
// no in-bounds element, which valid PyTorch parameters never produce.
template <typename T>
static __device__ __forceinline__ long long
maxpool_window_argmax(const T* __restrict__ plane, long long H, long long W,
                      long long oh, long long ow, int kh, int kw, int sh, int sw,
                      int ph, int pw, int dh, int dw, float* max_out)
{
    const long long h0 = oh * sh - ph;
    const long long w0 = ow * sw - pw;
    long long best = -1;
    float maxval = neg_inf_f();
    for (int r = 0; r < kh; ++r) {
        const long long h = h0 + (long long)r * dh;
        if (h < 0 || h >= H) continue;
        for (int c = 0; c < kw; ++c) {
            const long long w = w0 + (long long)c * dw;
            if (w < 0 || w >= W) continue;
            const long long idx = h * W + w;
            const float val = load(plane, idx);
            if (best < 0) best = idx;  // first in-bounds position
            if (val > maxval || val != val) {
                maxval = val;
                best = idx;
            }
        }
    }
    *max_out = maxval;
    return best;
}

// y[n, c, oh, ow] = max over the (dilated) window, padding = -inf.
// One thread per output element.
template <typename T>
static __device__ void maxpool2d_forward_body(T* __restrict__ y, const T* __restrict__ x,
                                              long long N, long long C, long long H, long long W,
                                              long long OH, long long OW, int kh, int kw, int sh,
                                              int sw, int ph, int pw, int dh, int dw)
{
    GRID_STRIDE_LOOP(i, N * C * OH * OW)
    {
        const long long ow = i % OW;
        const long long oh = (i / OW) % OH;
        const long long nc = i / (OW * OH);
        float m;
        maxpool_window_argmax(x + nc * H * W, H, W, oh, ow, kh, kw, sh, sw, ph,
                              pw, dh, dw, &m);
        store(y, i, m);
    }
}

extern "C" __global__ void maxpool2d_forward(float* __restrict__ y,
        const float* __restrict__ x, long long N, long long C, long long H, long long W,
        long long OH, long long OW, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw)
{
    maxpool2d_forward_body(y, x, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw);
}

// Backward of max_pool2d: dx[argmax(window)] += dy[n, c, oh, ow].
// The argmax is recomputed from the INPUT x with the forward's rule (no
// index tensor is stored), and scattered with atomicAdd because overlapping
// windows can share an argmax. THE HOST MUST ZERO dx FIRST. One thread per
// output element. (Float atomics make the summation order, hence the last
// bits of dx where windows overlap, nondeterministic, as in PyTorch on CUDA.)
extern "C" __global__ void maxpool2d_backward(float* __restrict__ dx,
                                              const float* __restrict__ dy,
                                              const float* __restrict__ x,
                                              long long N, long long C,
                                              long long H, long long W,
                                              long long OH, long long OW,
                                              int kh, int kw, int sh, int sw,
                                              int ph, int pw, int dh, int dw)
{
    GRID_STRIDE_LOOP(i, N * C * OH * OW)
    {
        const long long ow = i % OW;
        const long long oh = (i / OW) % OH;
        const long long nc = i / (OW * OH);
        float m;
        const long long idx = maxpool_window_argmax(
            x + nc * H * W, H, W, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, &m);
        if (idx >= 0) atomicAdd(dx + nc * H * W + idx, dy[i]);
    }
}

// The half forms of max_pool2d's backward GATHER (a half value cannot take an
// atomic float32 sum): one thread per input element adds dy over the windows
// whose argmax (the forward's rule, recomputed from x) it is, in row-major
// output order, in float32, and stores once. Overwrites dx (no zeroing).
template <typename T>
static __device__ void maxpool2d_backward_gather(T* __restrict__ dx, const T* __restrict__ dy,
                                                 const T* __restrict__ x, long long N, long long C,
                                                 long long H, long long W, long long OH, long long OW,
                                                 int kh, int kw, int sh, int sw, int ph, int pw,
                                                 int dh, int dw)
{
    GRID_STRIDE_LOOP(i, N * C * H * W)
    {
        const long long w = i % W;
        const long long h = (i / W) % H;
        const long long nc = i / (W * H);
        const long long idx = h * W + w;
        const T* plane = x + nc * H * W;
        float g = 0.0f;
        for (int r = kh - 1; r >= 0; --r) {  // oh ascending
            const long long oh_s = h + ph - (long long)r * dh;
            if (oh_s < 0 || oh_s % sh != 0 || oh_s / sh >= OH) continue;
            const long long oh = oh_s / sh;
            for (int c = kw - 1; c >= 0; --c) {  // ow ascending
                const long long ow_s = w + pw - (long long)c * dw;
                if (ow_s < 0 || ow_s % sw != 0 || ow_s / sw >= OW) continue;
                const long long ow = ow_s / sw;
                float m;
                if (maxpool_window_argmax(plane, H, W, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, &m) == idx)
                    g += load(dy, (nc * OH + oh) * OW + ow);
            }
        }
        store(dx, i, g);
    }
}

// ---------------------------------------------------------------------------
// Average pooling (torch.nn.functional.avg_pool2d; no dilation)
//
// For output (oh, ow), as in PyTorch's CUDA kernel:
//     hstart = oh*sh - ph,  hend = min(hstart + kh, H + ph)   (same for w)
//     pool_size = (hend - hstart) * (wend - wstart)   (window incl. padding)
//     clip hstart/hend to [0, H], wstart/wend to [0, W]
//     divisor = divisor_override            if divisor_override != 0
//             = pool_size                   if count_include_pad
//             = (hend - hstart)*(wend - wstart)   (in-bounds elements only)
// A window with no in-bounds element (possible with ceil_mode) outputs 0.
// ---------------------------------------------------------------------------

struct AvgWindow {
    long long hstart, hend, wstart, wend;
    float divisor;
    bool empty;
};

static __device__ __forceinline__ AvgWindow
avgpool_window(long long H, long long W, long long oh, long long ow, int kh,
               int kw, int sh, int sw, int ph, int pw, int count_include_pad,
               int divisor_override)
{
    AvgWindow win;
    long long hstart = oh * sh - ph;
    long long wstart = ow * sw - pw;
    long long hend = hstart + kh;
    long long wend = wstart + kw;
    if (hend > H + ph) hend = H + ph;
    if (wend > W + pw) wend = W + pw;
    const long long pool_size = (hend - hstart) * (wend - wstart);
    if (hstart < 0) hstart = 0;
    if (wstart < 0) wstart = 0;
    if (hend > H) hend = H;
    if (wend > W) wend = W;
    win.hstart = hstart;
    win.hend = hend;
    win.wstart = wstart;
    win.wend = wend;
    win.empty = (hstart >= hend || wstart >= wend);
    long long div;
    if (divisor_override != 0) {
        div = divisor_override;
    } else if (count_include_pad) {
        div = pool_size;
    } else {
        div = (hend - hstart) * (wend - wstart);
    }
    win.divisor = (float)div;
    return win;
}

// y[n, c, oh, ow] = sum(window) / divisor.  One thread per output element.
// divisor_override = 0 means "None".
template <typename T>
static __device__ void avgpool2d_forward_body(T* __restrict__ y, const T* __restrict__ x,
                                              long long N, long long C, long long H, long long W,
                                              long long OH, long long OW, int kh, int kw, int sh,
                                              int sw, int ph, int pw, int count_include_pad,
                                              int divisor_override)
{
    GRID_STRIDE_LOOP(i, N * C * OH * OW)
    {
        const long long ow = i % OW;
        const long long oh = (i / OW) % OH;
        const long long nc = i / (OW * OH);
        const AvgWindow win = avgpool_window(H, W, oh, ow, kh, kw, sh, sw, ph,
                                             pw, count_include_pad,
                                             divisor_override);
        if (win.empty) {
            store(y, i, 0.0f);
            continue;
        }
        const T* plane = x + nc * H * W;
        float s = 0.0f;
        for (long long h = win.hstart; h < win.hend; ++h)
            for (long long w = win.wstart; w < win.wend; ++w) s += load(plane, h * W + w);
        store(y, i, s / win.divisor);
    }
}

extern "C" __global__ void avgpool2d_forward(float* __restrict__ y,
        const float* __restrict__ x, long long N, long long C, long long H, long long W,
        long long OH, long long OW, int kh, int kw, int sh, int sw, int ph, int pw,
        int count_include_pad, int divisor_override)
{
    avgpool2d_forward_body(y, x, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, count_include_pad,
                           divisor_override);
}

// Backward of avg_pool2d, as a GATHER (deterministic, no atomics): one thread
// per INPUT element sums dy / divisor over the output windows that contain
// it. Overwrites dx entirely (no zeroing needed).
template <typename T>
static __device__ void avgpool2d_backward_body(T* __restrict__ dx,
                                              const T* __restrict__ dy,
                                              long long N, long long C,
                                              long long H, long long W,
                                              long long OH, long long OW,
                                              int kh, int kw, int sh, int sw,
                                              int ph, int pw,
                                              int count_include_pad,
                                              int divisor_override)
{
    GRID_STRIDE_LOOP(i, N * C * H * W)
    {
        // Coordinates in the padded frame.
        const long long w = i % W + pw;
        const long long h = (i / W) % H + ph;
        const long long nc = i / (W * H);
        // Outputs whose window [o*s, o*s + k) (padded frame) contains h / w.
        const long long oh_lo = (h < kh) ? 0 : (h - kh) / sh + 1;
        long long oh_hi = h / sh + 1;
        if (oh_hi > OH) oh_hi = OH;
        const long long ow_lo = (w < kw) ? 0 : (w - kw) / sw + 1;
        long long ow_hi = w / sw + 1;
        if (ow_hi > OW) ow_hi = OW;

        const T* dplane = dy + nc * OH * OW;
        float g = 0.0f;
        for (long long oh = oh_lo; oh < oh_hi; ++oh) {
            for (long long ow = ow_lo; ow < ow_hi; ++ow) {
                const AvgWindow win = avgpool_window(H, W, oh, ow, kh, kw, sh,
                                                     sw, ph, pw,
                                                     count_include_pad,
                                                     divisor_override);
                if (win.empty) continue;
                g += load(dplane, oh * OW + ow) / win.divisor;
            }
        }
        store(dx, i, g);
    }
}

extern "C" __global__ void avgpool2d_backward(float* __restrict__ dx,
        const float* __restrict__ dy, long long N, long long C, long long H, long long W,
        long long OH, long long OW, int kh, int kw, int sh, int sw, int ph, int pw,
        int count_include_pad, int divisor_override)
{
    avgpool2d_backward_body(dx, dy, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, count_include_pad,
                            divisor_override);
}

// ---------------------------------------------------------------------------
// Global average pooling (adaptive_avg_pool2d(x, 1) == x.mean((2, 3), keepdim))
//
// x is viewed as (NC, HW) rows with NC = N*C and HW = H*W; y is (NC,).
// ---------------------------------------------------------------------------

// y[r] = mean(x[r, :]).  ONE WARP PER ROW: warps grid-stride over rows, the
// 32 lanes stride over the row (coalesced) and combine with warp shuffles.
// REQUIRES blockDim.x to be a multiple of 32 (launch_config uses 256).
template <typename T>
static __device__ void global_avgpool_forward_body(T* __restrict__ y, const T* __restrict__ x,
                                                   long long NC, long long HW)
{
    const unsigned int lane = threadIdx.x & 31u;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long num_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    // `row` is uniform across a warp, so the whole warp stays converged for
    // the full-mask shuffles below.
    for (long long row = warp; row < NC; row += num_warps) {
        const T* xr = x + row * HW;
        float s = 0.0f;
        for (long long j = lane; j < HW; j += 32) s += load(xr, j);
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) store(y, row, s / (float)HW);
    }
}

extern "C" __global__ void global_avgpool_forward(float* __restrict__ y,
        const float* __restrict__ x, long long NC, long long HW)
{
    global_avgpool_forward_body(y, x, NC, HW);
}

// dx[r, j] = dy[r] / HW.  One thread per input element (grid-stride).
template <typename T>
static __device__ void global_avgpool_backward_body(T* __restrict__ dx, const T* __restrict__ dy,
                                                    long long NC, long long HW)
{
    const float hw = (float)HW;
    GRID_STRIDE_LOOP(i, NC * HW) { store(dx, i, load(dy, i / HW) / hw); }
}

extern "C" __global__ void global_avgpool_backward(float* __restrict__ dx,
        const float* __restrict__ dy, long long NC, long long HW)
{
    global_avgpool_backward_body(dx, dy, NC, HW);
}

// ---------------------------------------------------------------------------
// Half entry points, written once for both halves: HALF(name) is <name>_bf16
// or <name>_f16 and half_t that storage, as kernel_specs.module_source
// defines them before the text of a bf16 or fp16 run. A float32 run's text
// leaves HALF undefined, so it compiles none of them.
// ---------------------------------------------------------------------------
#ifdef HALF

extern "C" __global__ void HALF(maxpool2d_forward)(half_t* __restrict__ y, const half_t* __restrict__ x,
        long long N, long long C, long long H, long long W, long long OH, long long OW, int kh, int kw, int sh,
        int sw, int ph, int pw, int dh, int dw)
{
    maxpool2d_forward_body(y, x, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw);
}

extern "C" __global__ void HALF(maxpool2d_backward)(half_t* __restrict__ dx, const half_t* __restrict__ dy,
        const half_t* __restrict__ x, long long N, long long C, long long H, long long W, long long OH,
        long long OW, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw)
{
    maxpool2d_backward_gather(dx, dy, x, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw);
}

extern "C" __global__ void HALF(avgpool2d_forward)(half_t* __restrict__ y, const half_t* __restrict__ x,
        long long N, long long C, long long H, long long W, long long OH, long long OW, int kh, int kw, int sh,
        int sw, int ph, int pw, int count_include_pad, int divisor_override)
{
    avgpool2d_forward_body(y, x, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, count_include_pad,
                           divisor_override);
}

extern "C" __global__ void HALF(avgpool2d_backward)(half_t* __restrict__ dx, const half_t* __restrict__ dy,
        long long N, long long C, long long H, long long W, long long OH, long long OW, int kh, int kw, int sh,
        int sw, int ph, int pw, int count_include_pad, int divisor_override)
{
    avgpool2d_backward_body(dx, dy, N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, count_include_pad,
                            divisor_override);
}

extern "C" __global__ void HALF(global_avgpool_forward)(half_t* __restrict__ y, const half_t* __restrict__ x,
        long long NC, long long HW)
{
    global_avgpool_forward_body(y, x, NC, HW);
}

extern "C" __global__ void HALF(global_avgpool_backward)(half_t* __restrict__ dx, const half_t* __restrict__ dy,
        long long NC, long long HW)
{
    global_avgpool_backward_body(dx, dy, NC, HW);
}

#endif  // HALF
