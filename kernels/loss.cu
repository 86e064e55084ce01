// minidl CUDA kernels: softmax cross-entropy loss.
//
// Mirrors torch.nn.functional.cross_entropy(logits, labels) for logits of
// shape (N, K) (float32, or bf16 / fp16 in the `_bf16` / `_f16` forms; the
// row losses are float32 in every form), contiguous, and class-index labels of shape (N,)
// (int64), i.e. log_softmax followed by nll_loss, with reduction='none'
// (softmax_xent_forward) or 'mean' (+ softmax_xent_mean).
//
// Loaded with cupy.RawModule (NVRTC): device code only, no #include, every
// entry point `extern "C" __global__`. See elementwise.cu for the shared
// conventions (outputs first, `long long` sizes, grid-stride loops).
//
// Launch: ONE BLOCK PER ROW. Blocks grid-stride over rows (row = blockIdx.x,
// blockIdx.x + gridDim.x, ...), so any grid size is correct; the threads of a
// block stride over the K classes of the row and combine through a shared-
// memory tree reduction. blockDim.x may be any value in [1, 1024] (a power of
// two, as kernel_specs.launch_config picks, is the efficient choice).
//
// Invalid labels: a label outside [0, K) (PyTorch would raise, and there is
// no ignore_index here) makes that row's loss NaN and that row's gradient
// NaN, so the error is visible in the mean loss instead of silently reading
// out of bounds. NaN logits propagate to the row's loss/gradient as well.

#define LOSS_MAX_THREADS 1024

// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce), then kernels/half_storage.cuh (bf16/f16 types, load, store).

// Row statistics of log_softmax: m = max_j x[j], log_s = log sum_j exp(x[j] - m).
template <typename T>
static __device__ void row_logsumexp(const T* xr, long long K, float* smem,
                                     float* m_out, float* log_s_out)
{
    float m = neg_inf_f();
    for (long long j = threadIdx.x; j < K; j += blockDim.x) m = nan_max(m, load(xr, j));
    m = block_reduce<true>(m, smem);

    float s = 0.0f;
    for (long long j = threadIdx.x; j < K; j += blockDim.x) s += expf(load(xr, j) - m);
    s = block_reduce<false>(s, smem);

    *m_out = m;
    *log_s_out = logf(s);
}

// loss[r] = -log_softmax(logits[r])[labels[r]]
//         = log(sum_j exp(x_j - m)) - (x_label - m),  m = max_j x_j
// (F.cross_entropy(..., reduction='none')). NaN for an invalid label.
template <typename T>
static __device__ void softmax_xent_forward_body(float* __restrict__ loss, const T* __restrict__ logits,
                                                 const long long* __restrict__ labels, long long N, long long K)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const T* xr = logits + row * K;
        float m, log_s;
        row_logsumexp(xr, K, smem, &m, &log_s);
        if (threadIdx.x == 0) {
            const long long t = labels[row];
            loss[row] = (t >= 0 && t < K) ? log_s - (load(xr, t) - m) : nan_f();
        }
    }
}

extern "C" __global__ void softmax_xent_forward(float* __restrict__ loss,
        const float* __restrict__ logits, const long long* __restrict__ labels, long long N, long long K)
{
    softmax_xent_forward_body(loss, logits, labels, N, K);
}

// out[0] = mean(loss[0:N])            (reduction='mean'; NaN when N == 0, as
// torch's mean of an empty tensor). Single block: launch with grid (1,);
// extra blocks return immediately. Any blockDim.x <= 1024.
extern "C" __global__ void softmax_xent_mean(float* __restrict__ out,
                                             const float* __restrict__ loss,
                                             long long N)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    if (blockIdx.x != 0) return;
    float s = 0.0f;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) s += loss[i];
    s = block_reduce<false>(s, smem);
    if (threadIdx.x == 0) out[0] = s / (float)N;
}

// dlogits[r, j] = (softmax(logits[r])[j] - (j == labels[r])) * scale
// Backward of F.cross_entropy; scale = dloss / N for reduction='mean'
// (dloss for 'sum'). softmax is computed as exp(x - m - log_s), like
// PyTorch's log_softmax backward. A row with an invalid label gets NaN.
// `dlogits` may alias `logits` (the row is fully read before it is written).
// The half forms take the loss's float32 gradient `dloss` and multiply by it
// before their one rounding: the float32 form's host multiplies afterwards.
template <typename T>
static __device__ void softmax_xent_backward_body(T* dlogits, const T* logits,
                                                  const long long* __restrict__ labels, long long N,
                                                  long long K, float scale, const float* dloss)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const T* xr = logits + row * K;
        T* dr = dlogits + row * K;
        float m, log_s;
        row_logsumexp(xr, K, smem, &m, &log_s);
        const long long t = labels[row];
        const bool valid = (t >= 0 && t < K);
        for (long long j = threadIdx.x; j < K; j += blockDim.x) {
            const float p = expf((load(xr, j) - m) - log_s);
            const float g = valid ? (p - (j == t ? 1.0f : 0.0f)) * scale : nan_f();
            store(dr, j, dloss ? g * dloss[0] : g);
        }
    }
}

extern "C" __global__ void softmax_xent_backward(float* dlogits, const float* logits,
        const long long* __restrict__ labels, long long N, long long K, float scale)
{
    softmax_xent_backward_body(dlogits, logits, labels, N, K, scale, (const float*)0);
}

// ---------------------------------------------------------------------------
// Cross-entropy over every token with an ignore index
// (F.cross_entropy(logits, labels, ignore_index=ignore_index), the mean over
// the rows whose label is not ignore_index; NaN when every row is ignored, as
// PyTorch's 0/0)
// ---------------------------------------------------------------------------

// Number of rows whose label is not `ignore_index`, as a float (single block).
static __device__ float count_kept(const long long* labels, long long N,
                                   long long ignore_index, float* smem)
{
    float c = 0.0f;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) c += labels[i] != ignore_index ? 1.0f : 0.0f;
    return block_reduce<false>(c, smem);
}

// loss[r] = softmax_xent_forward's row loss, 0 for an ignored row (its label
// is ignore_index); NaN for any other label outside [0, K).
template <typename T>
static __device__ void softmax_xent_ignore_forward_body(float* __restrict__ loss,
                                                        const T* __restrict__ logits,
                                                        const long long* __restrict__ labels,
                                                        long long N, long long K, long long ignore_index)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const long long t = labels[row];
        if (t == ignore_index) {  // the same for every thread of the block: no reduction skipped by half of it
            if (threadIdx.x == 0) loss[row] = 0.0f;
            continue;
        }
        const T* xr = logits + row * K;
        float m, log_s;
        row_logsumexp(xr, K, smem, &m, &log_s);
        if (threadIdx.x == 0) loss[row] = (t >= 0 && t < K) ? log_s - (load(xr, t) - m) : nan_f();
    }
}

extern "C" __global__ void softmax_xent_ignore_forward(float* __restrict__ loss,
        const float* __restrict__ logits, const long long* __restrict__ labels, long long N, long long K,
        long long ignore_index)
{
    softmax_xent_ignore_forward_body(loss, logits, labels, N, K, ignore_index);
}

// out[0] = sum(loss[:N]) / (rows not ignored). Single block, as
// softmax_xent_mean.
extern "C" __global__ void softmax_xent_ignore_mean(float* __restrict__ out,
                                                    const float* __restrict__ loss,
                                                    const long long* __restrict__ labels,
                                                    long long N, long long ignore_index)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    if (blockIdx.x != 0) return;
    const float kept = count_kept(labels, N, ignore_index, smem);
    float s = 0.0f;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) s += loss[i];
    s = block_reduce<false>(s, smem);
    if (threadIdx.x == 0) out[0] = s / kept;
}

// scale[0] = dloss[0] / (rows not ignored): the gradient's factor, computed
// on the device so the backward needs no host round trip. Single block.
extern "C" __global__ void softmax_xent_ignore_scale(float* __restrict__ scale,
                                                     const float* __restrict__ dloss,
                                                     const long long* __restrict__ labels,
                                                     long long N, long long ignore_index)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    if (blockIdx.x != 0) return;
    const float kept = count_kept(labels, N, ignore_index, smem);
    if (threadIdx.x == 0) scale[0] = dloss[0] / kept;
}

// dlogits[r] = (softmax(logits[r]) - onehot(labels[r])) * scale[0], zeros
// for an ignored row, NaN for any other invalid label. `dlogits` may alias
// `logits`.
template <typename T>
static __device__ void softmax_xent_ignore_backward_body(T* dlogits, const T* logits,
                                                         const long long* __restrict__ labels,
                                                         const float* __restrict__ scale,
                                                         long long N, long long K, long long ignore_index)
{
    __shared__ float smem[LOSS_MAX_THREADS];
    const float sc = scale[0];
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        T* dr = dlogits + row * K;
        const long long t = labels[row];
        if (t == ignore_index) {
            for (long long j = threadIdx.x; j < K; j += blockDim.x) store(dr, j, 0.0f);
            continue;
        }
        const T* xr = logits + row * K;
        float m, log_s;
        row_logsumexp(xr, K, smem, &m, &log_s);
        const bool valid = (t >= 0 && t < K);
        for (long long j = threadIdx.x; j < K; j += blockDim.x) {
            const float p = expf((load(xr, j) - m) - log_s);
            store(dr, j, valid ? (p - (j == t ? 1.0f : 0.0f)) * sc : nan_f());
        }
    }
}

extern "C" __global__ void softmax_xent_ignore_backward(float* dlogits, const float* logits,
        const long long* __restrict__ labels, const float* __restrict__ scale, long long N, long long K,
        long long ignore_index)
{
    softmax_xent_ignore_backward_body(dlogits, logits, labels, scale, N, K, ignore_index);
}

// ---------------------------------------------------------------------------
// Half entry points, written once for both halves: HALF(name) is <name>_bf16
// or <name>_f16 and half_t that storage, as kernel_specs.module_source
// defines them before the text of a bf16 or fp16 run. A float32 run's text
// leaves HALF undefined, so it compiles none of them.
// ---------------------------------------------------------------------------
#ifdef HALF

extern "C" __global__ void HALF(softmax_xent_forward)(float* __restrict__ loss, const half_t* __restrict__ logits,
        const long long* __restrict__ labels, long long N, long long K)
{
    softmax_xent_forward_body(loss, logits, labels, N, K);
}

extern "C" __global__ void HALF(softmax_xent_backward)(half_t* dlogits, const half_t* logits,
        const long long* __restrict__ labels, long long N, long long K, float scale,
        const float* __restrict__ dloss)
{
    softmax_xent_backward_body(dlogits, logits, labels, N, K, scale, dloss);
}

extern "C" __global__ void HALF(softmax_xent_ignore_forward)(float* __restrict__ loss,
        const half_t* __restrict__ logits, const long long* __restrict__ labels, long long N, long long K,
        long long ignore_index)
{
    softmax_xent_ignore_forward_body(loss, logits, labels, N, K, ignore_index);
}

extern "C" __global__ void HALF(softmax_xent_ignore_backward)(half_t* dlogits, const half_t* logits,
        const long long* __restrict__ labels, const float* __restrict__ scale, long long N, long long K,
        long long ignore_index)
{
    softmax_xent_ignore_backward_body(dlogits, logits, labels, scale, N, K, ignore_index);
}

#endif  // HALF
