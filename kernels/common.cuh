// ---------------------------------------------------------------------------
// Device code every kernel file shares, put before the text of each when it is
// compiled (kernel_specs.module_source: NVRTC takes no #include): the
// grid-stride loop, -inf and NaN as bits, a max that keeps NaN, and the
// block's tree reduction. Functions are inline, not static: a file that uses
// none of them compiles without NVRTC's unreferenced-function warning.
// ---------------------------------------------------------------------------
#define GRID_STRIDE_LOOP(i, n)                                                 \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
         i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ float neg_inf_f() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fffffff); }

// max that propagates NaN (fmaxf would drop it).
__device__ __forceinline__ float nan_max(float a, float b)
{
    return (a > b || a != a) ? a : b;
}

// Tree reduction over the block through `smem` (blockDim.x floats, at most
// 1024). Works for any blockDim.x, power of two or not. Every thread of the
// block must call it; every thread receives the result.
template <bool IS_MAX>
__device__ float block_reduce(float v, float* smem)
{
    const unsigned int tid = threadIdx.x;
    const unsigned int nt = blockDim.x;
    smem[tid] = v;
    __syncthreads();
    unsigned int p = 1;  // smallest power of two >= nt
    while (p < nt) p <<= 1;
    for (unsigned int s = p >> 1; s > 0; s >>= 1) {
        if (tid < s && tid + s < nt) {
            smem[tid] = IS_MAX ? nan_max(smem[tid], smem[tid + s])
                               : smem[tid] + smem[tid + s];
        }
        __syncthreads();
    }
    const float r = smem[0];
    __syncthreads();  // smem is reused by the caller's next reduction
    return r;
}
