// ---------------------------------------------------------------------------
// Half storage, put before the text of every file with half forms when it is
// compiled (kernel_specs.module_source: NVRTC takes no #include). A bf16 or fp16 value travels as
// its 16 bits; a kernel reads it into float32 exactly, computes in float32 as
// its float32 form does, and rounds once when it stores: to nearest even,
// fp16 overflowing to inf, a NaN staying a NaN (minidl/backend/precision.py,
// the CPU's minidl/backend/cpu/half_jit.py). A kernel's body is a template on
// its storage type; its entry points are <name> (float), and <name>_bf16 and
// <name>_f16 in the file's HALF block, compiled in a bf16 or fp16 run's text.
// The functions are inline, not static: a text instantiates one half or none,
// and NVRTC warns of an unreferenced static function.
// ---------------------------------------------------------------------------
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }

__device__ __forceinline__ float load(const bf16* p, long long i)
{
    return __uint_as_float((unsigned int)p[i].bits << 16);
}

__device__ __forceinline__ float load(const f16* p, long long i)
{
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(p[i].bits));
    return v;
}

__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }

__device__ __forceinline__ void store(bf16* p, long long i, float v)
{
    const unsigned int u = __float_as_uint(v);
    p[i].bits = (u & 0x7fffffffu) > 0x7f800000u
        ? (unsigned short)((u >> 16) | 0x40u)                        // NaN: quiet, sign kept
        : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // nearest, ties to even
}

__device__ __forceinline__ void store(f16* p, long long i, float v)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}
// ---------------------------------------------------------------------------
// End of half storage.
// ---------------------------------------------------------------------------
