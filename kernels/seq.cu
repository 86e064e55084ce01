// minidl CUDA kernels: the sequence models' layers (layer norm, GELU, softmax
// over the last axis, embedding gather and its gradient).
//
// Loaded with cupy.RawModule (NVRTC): device code only, no #include, every
// entry point `extern "C" __global__`. See elementwise.cu for the shared
// conventions (outputs first, `long long` sizes, grid-stride loops).
//
// Rows: a (B, T, C) tensor is R = B*T rows of C contiguous values (float32,
// or bf16 / fp16 in the `_bf16` / `_f16` forms; statistics, weights and their
// gradients are float32 in every form). "Row"
// kernels run ONE BLOCK PER ROW (blocks grid-stride over rows, so any grid is
// correct; the threads of a block stride over the row's C values and combine
// through a shared-memory tree reduction; any blockDim.x <= 1024).
//
// Determinism: every sum has a fixed order for a given launch (the tree
// reduction; the column sums of layer norm's backward and the gradient of
// embedding_backward have one owner thread per value, which walks its rows in
// order), never an atomic, so a recomputed forward gives the bits that ran and a step is
// bit-identical from run to run, as the CPU backend's kernels are.

#define SEQ_MAX_THREADS 1024

// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce), then kernels/half_storage.cuh (bf16/f16 types, load, store).

// ---------------------------------------------------------------------------
// Layer norm over the last axis                   (F.layer_norm(x, (C,), w, b))
// ---------------------------------------------------------------------------

// One output of layer norm, ((x - m) * r) * w[j] + b[j] (w, b may be NULL), in
// round-to-nearest intrinsics: the compiler may not contract them into an
// FMA in one kernel and not the other, so layernorm_forward and
// layernorm_forward_apply give the same bits from the same statistics.
static __device__ __forceinline__ float ln_out(float x, float m, float r, const float* w,
                                               const float* b, long long j)
{
    float v = __fmul_rn(__fsub_rn(x, m), r);
    if (w) v = __fmul_rn(v, w[j]);
    if (b) v = __fadd_rn(v, b[j]);
    return v;
}

// y[r] = (x[r] - mean[r]) * rstd[r] * w + b, with mean[r] and rstd[r] =
// 1 / sqrt(var[r] + eps) written for backward; the variance is the mean of
// squared deviations from the row mean (two passes: no cancellation). w and b
// may be NULL (no affine weight / bias). The output is `ln_out`, as
// layernorm_forward_apply's, so a recomputed layer norm gives the same bits.
template <typename T>
static __device__ void layernorm_forward_body(T* y, float* mean, float* rstd, const T* x,
                                              const float* w, const float* b, long long R,
                                              long long C, float eps)
{
    __shared__ float smem[SEQ_MAX_THREADS];
    for (long long row = blockIdx.x; row < R; row += gridDim.x) {
        const T* xr = x + row * C;
        float s = 0.0f;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) s += load(xr, j);
        const float m = block_reduce<false>(s, smem) / (float)C;
        float q = 0.0f;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) {
            const float d = load(xr, j) - m;
            q += d * d;
        }
        const float r = 1.0f / sqrtf(block_reduce<false>(q, smem) / (float)C + eps);
        T* yr = y + row * C;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) store(yr, j, ln_out(load(xr, j), m, r, w, b, j));
        if (threadIdx.x == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    }
}

extern "C" __global__ void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, long long R, long long C, float eps)
{
    layernorm_forward_body(y, mean, rstd, x, w, b, R, C, eps);
}

// y from saved statistics: y[r, j] = ln_out(x[r, j], mean[r], rstd[r], ...).
// One thread per element.
template <typename T>
static __device__ void layernorm_forward_apply_body(T* y, const T* x, const float* w, const float* b,
                                                    const float* mean, const float* rstd, long long R,
                                                    long long C)
{
    GRID_STRIDE_LOOP(i, R * C) {
        const long long row = i / C;
        store(y, i, ln_out(load(x, i), mean[row], rstd[row], w, b, i - row * C));
    }
}

extern "C" __global__ void layernorm_forward_apply(float* y, const float* x, const float* w, const float* b, const float* mean, const float* rstd, long long R, long long C)
{
    layernorm_forward_apply_body(y, x, w, b, mean, rstd, R, C);
}

// dx of layer norm: with g = dy * w (w NULL: g = dy) and xhat = (x - mean)
// * rstd, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per row. dx may
// alias dy: each thread writes only the columns it reads, after both means
// are complete.
template <typename T>
static __device__ void layernorm_backward_dx_body(T* dx, const T* x, const float* w, const T* dy,
                                                  const float* mean, const float* rstd, long long R,
                                                  long long C)
{
    __shared__ float smem[SEQ_MAX_THREADS];
    for (long long row = blockIdx.x; row < R; row += gridDim.x) {
        const T* xr = x + row * C;
        const T* dyr = dy + row * C;
        const float m = mean[row], r = rstd[row];
        float s1 = 0.0f, s2 = 0.0f;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) {
            const float g = w ? load(dyr, j) * w[j] : load(dyr, j);
            s1 += g;
            s2 += g * ((load(xr, j) - m) * r);
        }
        const float c1 = block_reduce<false>(s1, smem) / (float)C;
        const float c2 = block_reduce<false>(s2, smem) / (float)C;
        T* dxr = dx + row * C;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) {
            const float g = w ? load(dyr, j) * w[j] : load(dyr, j);
            store(dxr, j, r * (g - c1 - ((load(xr, j) - m) * r) * c2));
        }
    }
}

extern "C" __global__ void layernorm_backward_dx(float* dx, const float* x, const float* w, const float* dy, const float* mean, const float* rstd, long long R, long long C)
{
    layernorm_backward_dx_body(dx, x, w, dy, mean, rstd, R, C);
}

// The weight and bias gradients of layer norm, in two deterministic passes.
// layernorm_backward_partials: for chunk g of `chunk` rows (the last may be
// shorter) and column j, pw[g, j] = sum of dy * xhat and pb[g, j] = sum of dy
// over the chunk's rows in row order, in double; one thread per (chunk,
// column), adjacent threads on adjacent columns.
template <typename T>
static __device__ void layernorm_backward_partials_body(double* pw, double* pb, const T* x, const T* dy,
                                                        const float* mean, const float* rstd, long long R,
                                                        long long C, long long chunk)
{
    const long long nchunks = (R + chunk - 1) / chunk;
    GRID_STRIDE_LOOP(i, nchunks * C) {
        const long long g = i / C, j = i - g * C;
        const long long stop = (g + 1) * chunk < R ? (g + 1) * chunk : R;
        double sw = 0.0, sb = 0.0;
        for (long long row = g * chunk; row < stop; ++row) {
            const float d = load(dy, row * C + j);
            sw += (double)(d * ((load(x, row * C + j) - mean[row]) * rstd[row]));
            sb += (double)d;
        }
        pw[i] = sw;
        pb[i] = sb;
    }
}

extern "C" __global__ void layernorm_backward_partials(double* pw, double* pb, const float* x, const float* dy, const float* mean, const float* rstd, long long R, long long C, long long chunk)
{
    layernorm_backward_partials_body(pw, pb, x, dy, mean, rstd, R, C, chunk);
}

// layernorm_backward_params: dw[j] = sum over the chunks of pw[g, j], db[j]
// likewise, in chunk order (one thread per column). Either output may be
// NULL.
extern "C" __global__ void layernorm_backward_params(float* dw, float* db,
                                                     const double* pw,
                                                     const double* pb,
                                                     long long nchunks,
                                                     long long C)
{
    GRID_STRIDE_LOOP(j, C) {
        double sw = 0.0, sb = 0.0;
        for (long long g = 0; g < nchunks; ++g) {
            sw += pw[g * C + j];
            sb += pb[g * C + j];
        }
        if (dw) dw[j] = (float)sw;
        if (db) db[j] = (float)sb;
    }
}

// ---------------------------------------------------------------------------
// GELU                       (F.gelu(x), F.gelu(x, approximate='tanh'))
// ---------------------------------------------------------------------------

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_INV_SQRT_2 0.7071067811865476f
#define GELU_INV_SQRT_2PI 0.3989422804014327f
#define GELU_CUBIC 0.044715f

// exact != 0: y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2));
// exact == 0: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
static __device__ void gelu_forward_body(T* y, const T* x, long long n, int exact)
{
    GRID_STRIDE_LOOP(i, n) {
        const float a = load(x, i);
        if (exact) {
            store(y, i, 0.5f * a * (1.0f + erff(a * GELU_INV_SQRT_2)));
        } else {
            const float t = tanhf(GELU_SQRT_2_OVER_PI * a * (1.0f + GELU_CUBIC * a * a));
            store(y, i, 0.5f * a * (1.0f + t));
        }
    }
}

extern "C" __global__ void gelu_forward(float* y, const float* x, long long n, int exact)
{
    gelu_forward_body(y, x, n, exact);
}

// dx = dy * GELU'(x): exact: Phi(x) + x phi(x); tanh form: 0.5 (1 + t) +
// 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2). dx may alias dy.
template <typename T>
static __device__ void gelu_backward_body(T* dx, const T* x, const T* dy, long long n, int exact)
{
    GRID_STRIDE_LOOP(i, n) {
        const float a = load(x, i);
        float slope;
        if (exact) {
            slope = 0.5f * (1.0f + erff(a * GELU_INV_SQRT_2))
                  + a * GELU_INV_SQRT_2PI * expf(-0.5f * a * a);
        } else {
            const float t = tanhf(GELU_SQRT_2_OVER_PI * a * (1.0f + GELU_CUBIC * a * a));
            slope = 0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * GELU_SQRT_2_OVER_PI
                  * (1.0f + 3.0f * GELU_CUBIC * a * a);
        }
        store(dx, i, load(dy, i) * slope);
    }
}

extern "C" __global__ void gelu_backward(float* dx, const float* x, const float* dy, long long n, int exact)
{
    gelu_backward_body(dx, x, dy, n, exact);
}

// ---------------------------------------------------------------------------
// Softmax over the last axis, and attention's masked, scaled softmax
// ---------------------------------------------------------------------------

// y[r] = softmax(x[r] * scale) over the C values of row r. causal_t > 0 masks
// the keys after the query: row r is query (r mod causal_t) of a (T, T) score
// matrix (C == causal_t) and keys j > r mod T get exactly 0 (attention's
// causal mask). causal_t == 0: every key (F.softmax(x * scale, -1)). y may
// alias x (attention normalizes its scores in place): each thread writes only
// the values it read, after both reductions are complete.
template <typename T>
static __device__ void softmax_forward_body(T* y, const T* x, long long R, long long C, float scale,
                                            long long causal_t)
{
    __shared__ float smem[SEQ_MAX_THREADS];
    for (long long row = blockIdx.x; row < R; row += gridDim.x) {
        const T* xr = x + row * C;
        const long long last = causal_t > 0 ? row % causal_t : C - 1;  // last key attended
        float m = neg_inf_f();
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) m = nan_max(m, load(xr, j) * scale);
        m = block_reduce<true>(m, smem);
        float s = 0.0f;
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) s += expf(load(xr, j) * scale - m);
        s = block_reduce<false>(s, smem);
        T* yr = y + row * C;
        for (long long j = threadIdx.x; j < C; j += blockDim.x)
            store(yr, j, j <= last ? expf(load(xr, j) * scale - m) / s : 0.0f);
    }
}

extern "C" __global__ void softmax_forward(float* y, const float* x, long long R, long long C, float scale, long long causal_t)
{
    softmax_forward_body(y, x, R, C, scale, causal_t);
}

// dx[r] = scale * y[r] * (dy[r] - sum_j dy[r, j] y[r, j]): the backward of
// softmax_forward from its output (masked entries have y = 0, so they get 0).
// dx may alias dy.
template <typename T>
static __device__ void softmax_backward_body(T* dx, const T* y, const T* dy, long long R, long long C,
                                             float scale)
{
    __shared__ float smem[SEQ_MAX_THREADS];
    for (long long row = blockIdx.x; row < R; row += gridDim.x) {
        const T* yr = y + row * C;
        const T* dyr = dy + row * C;
        float s = 0.0f;
        for (long long j = threadIdx.x; j < C; j += blockDim.x) s += load(dyr, j) * load(yr, j);
        const float dot = block_reduce<false>(s, smem);
        T* dxr = dx + row * C;
        for (long long j = threadIdx.x; j < C; j += blockDim.x)
            store(dxr, j, scale * (load(yr, j) * (load(dyr, j) - dot)));
    }
}

extern "C" __global__ void softmax_backward(float* dx, const float* y, const float* dy, long long R, long long C, float scale)
{
    softmax_backward_body(dx, y, dy, R, C, scale);
}

// ---------------------------------------------------------------------------
// Embedding                                       (F.embedding(idx, w))
// ---------------------------------------------------------------------------

// y[r, j] = w[idx[r], j] for R indices into a (V, C) table; an index outside
// [0, V) gives a NaN row (PyTorch raises; reading out of bounds is worse).
template <typename T>
static __device__ void embedding_forward_body(T* y, const float* w, const long long* idx, long long R,
                                              long long C, long long V)
{
    GRID_STRIDE_LOOP(i, R * C) {
        const long long row = i / C, j = i - row * C;
        const long long v = idx[row];
        store(y, i, (v >= 0 && v < V) ? w[v * C + j] : nan_f());
    }
}

extern "C" __global__ void embedding_forward(float* y, const float* w, const long long* idx, long long R, long long C, long long V)
{
    embedding_forward_body(y, w, idx, R, C, V);
}

// dw[v, j] = the sum of dy[r, j] over the rows r with idx[r] == v, in row
// order. Thread (g, j) owns column j of the table rows v in [g V / groups,
// (g + 1) V / groups) and walks every row, adding the ones whose index falls
// in its range: each value of dw has one owner and one order of sums
// (deterministic, where an atomic scatter is not), and `groups` threads per
// column keep the GPU busy where C alone would not. THE HOST MUST ZERO dw
// FIRST. Indices outside [0, V) are skipped.
template <typename T>
static __device__ void embedding_backward_body(float* dw, const T* dy, const long long* idx, long long R,
                                               long long C, long long V, long long groups)
{
    GRID_STRIDE_LOOP(i, groups * C) {
        const long long g = i / C, j = i - g * C;
        const long long lo = g * V / groups, hi = (g + 1) * V / groups;
        for (long long row = 0; row < R; ++row) {
            const long long v = idx[row];
            if (v >= lo && v < hi) dw[v * C + j] += load(dy, row * C + j);
        }
    }
}

extern "C" __global__ void embedding_backward(float* dw, const float* dy, const long long* idx, long long R, long long C, long long V, long long groups)
{
    embedding_backward_body(dw, dy, idx, R, C, V, groups);
}

// ---------------------------------------------------------------------------
// Position embedding                              (x + w[:T] for x of (B, T, C))
// ---------------------------------------------------------------------------

// y[b, j] = x[b, j] + w[j] over the TC = T*C values of the table's first T
// rows (w is the float32 master).
template <typename T>
static __device__ void position_embedding_forward_body(T* y, const T* x, const float* w, long long B,
                                                       long long TC)
{
    GRID_STRIDE_LOOP(i, B * TC) { store(y, i, load(x, i) + w[i % TC]); }
}

extern "C" __global__ void position_embedding_forward(float* y, const float* x, const float* w, long long B, long long TC)
{
    position_embedding_forward_body(y, x, w, B, TC);
}

// dw[j] = the sum of dy[b, j] over b in order (numpy's dy.sum(axis=0)), in
// float32, one thread per value; the host zeroes the table's rows past T.
template <typename T>
static __device__ void position_embedding_backward_body(float* dw, const T* dy, long long B, long long TC)
{
    GRID_STRIDE_LOOP(j, TC) {
        float s = 0.0f;
        for (long long b = 0; b < B; ++b) s += load(dy, b * TC + j);
        dw[j] = s;
    }
}

extern "C" __global__ void position_embedding_backward(float* dw, const float* dy, long long B, long long TC)
{
    position_embedding_backward_body(dw, dy, B, TC);
}

// ---------------------------------------------------------------------------
// Half entry points, written once for both halves: HALF(name) is <name>_bf16
// or <name>_f16 and half_t that storage, as kernel_specs.module_source
// defines them before the text of a bf16 or fp16 run. A float32 run's text
// leaves HALF undefined, so it compiles none of them.
// ---------------------------------------------------------------------------
#ifdef HALF

extern "C" __global__ void HALF(layernorm_forward)(half_t* y, float* mean, float* rstd, const half_t* x,
        const float* w, const float* b, long long R, long long C, float eps)
{
    layernorm_forward_body(y, mean, rstd, x, w, b, R, C, eps);
}

extern "C" __global__ void HALF(layernorm_forward_apply)(half_t* y, const half_t* x, const float* w, const float* b,
        const float* mean, const float* rstd, long long R, long long C)
{
    layernorm_forward_apply_body(y, x, w, b, mean, rstd, R, C);
}

extern "C" __global__ void HALF(layernorm_backward_dx)(half_t* dx, const half_t* x, const float* w,
        const half_t* dy, const float* mean, const float* rstd, long long R, long long C)
{
    layernorm_backward_dx_body(dx, x, w, dy, mean, rstd, R, C);
}

extern "C" __global__ void HALF(layernorm_backward_partials)(double* pw, double* pb, const half_t* x,
        const half_t* dy, const float* mean, const float* rstd, long long R, long long C, long long chunk)
{
    layernorm_backward_partials_body(pw, pb, x, dy, mean, rstd, R, C, chunk);
}

extern "C" __global__ void HALF(gelu_forward)(half_t* y, const half_t* x, long long n, int exact)
{
    gelu_forward_body(y, x, n, exact);
}

extern "C" __global__ void HALF(gelu_backward)(half_t* dx, const half_t* x, const half_t* dy, long long n,
        int exact)
{
    gelu_backward_body(dx, x, dy, n, exact);
}

extern "C" __global__ void HALF(softmax_forward)(half_t* y, const half_t* x, long long R, long long C, float scale,
        long long causal_t)
{
    softmax_forward_body(y, x, R, C, scale, causal_t);
}

extern "C" __global__ void HALF(softmax_backward)(half_t* dx, const half_t* y, const half_t* dy, long long R,
        long long C, float scale)
{
    softmax_backward_body(dx, y, dy, R, C, scale);
}

extern "C" __global__ void HALF(embedding_forward)(half_t* y, const float* w, const long long* idx, long long R,
        long long C, long long V)
{
    embedding_forward_body(y, w, idx, R, C, V);
}

extern "C" __global__ void HALF(embedding_backward)(float* dw, const half_t* dy, const long long* idx, long long R,
        long long C, long long V, long long groups)
{
    embedding_backward_body(dw, dy, idx, R, C, V, groups);
}

extern "C" __global__ void HALF(position_embedding_forward)(half_t* y, const half_t* x, const float* w, long long B,
        long long TC)
{
    position_embedding_forward_body(y, x, w, B, TC);
}

extern "C" __global__ void HALF(position_embedding_backward)(float* dw, const half_t* dy, long long B, long long TC)
{
    position_embedding_backward_body(dw, dy, B, TC);
}

#endif  // HALF
