// minidl CUDA kernels: fused optimizer steps (one launch per parameter tensor).
//
// Loaded with cupy.RawModule (NVRTC): device code only, no #include, every
// entry point `extern "C" __global__`. See elementwise.cu for the shared
// conventions (`long long` sizes, grid-stride loops).
//
// Tensors (param, grad, state buffers) are float32 and updated in place.
// Hyper-parameters are passed as `double`, like the Python floats PyTorch
// keeps them as: the derived scalars (1 - dampening, 1 - beta, bias
// corrections, lr / bias_correction1, ...) are computed in double once per
// thread and then rounded to float, which is what torch does when it applies
// a Python-float scalar to a float32 tensor. Computing them in float instead
// would be off by ~1e-5 relative for beta2 = 0.999 (1 - 0.999f != 0.001f).
// The element-wise arithmetic itself is float32, as in PyTorch.

// Put before this text when it is compiled (kernel_specs.module_source):
// kernels/common.cuh (GRID_STRIDE_LOOP, neg_inf_f, nan_f, nan_max,
// block_reduce).

// torch.optim.SGD step (maximize=False), for one parameter tensor:
//     g = grad + weight_decay * param                  (if weight_decay != 0)
//     if momentum != 0:
//         buf = g                                       on the first step
//         buf = momentum * buf + (1 - dampening) * g    afterwards
//         g   = g + momentum * buf    if nesterov  else  buf
//     param -= lr * g
// `first_step` != 0 on the step that creates the momentum buffer (PyTorch's
// "buf is None"); its previous contents are then ignored, so the host need
// not zero it. With momentum == 0 `momentum_buf` is never touched (may be
// NULL). `nesterov` != 0 requires momentum > 0 and dampening == 0 (PyTorch
// validates that on the host side).
static __device__ __forceinline__ void
sgd_body(float* __restrict__ param, const float* __restrict__ grad,
         float* __restrict__ momentum_buf, long long n, double lr,
         double momentum, double dampening, double weight_decay, int nesterov,
         int first_step)
{
    const float wd = (float)weight_decay;
    const float mu = (float)momentum;
    const float one_minus_damp = (float)(1.0 - dampening);
    const float neg_lr = (float)(-lr);
    const bool use_wd = (weight_decay != 0.0);
    const bool use_momentum = (momentum != 0.0);

    GRID_STRIDE_LOOP(i, n)
    {
        const float p = param[i];
        float g = grad[i];
        if (use_wd) g = g + wd * p;
        if (use_momentum) {
            float buf;
            if (first_step) {
                buf = g;
            } else {
                buf = momentum_buf[i] * mu + one_minus_damp * g;
            }
            momentum_buf[i] = buf;
            g = nesterov ? g + mu * buf : buf;
        }
        param[i] = p + neg_lr * g;
    }
}

extern "C" __global__ void sgd_update(float* __restrict__ param,
                                      const float* __restrict__ grad,
                                      float* __restrict__ momentum_buf,
                                      long long n, double lr, double momentum,
                                      double dampening, double weight_decay,
                                      int nesterov, int first_step)
{
    sgd_body(param, grad, momentum_buf, n, lr, momentum, dampening,
             weight_decay, nesterov, first_step);
}

// The same step with the learning rate read from device memory (`lr[0]`):
// what a CUDA graph replays (minidl/runtime/capture.py), since a launch argument is
// fixed at capture and a schedule changes the rate between steps. Same
// arithmetic as sgd_update, so both give the same bits for the same rate.
// `diverged[0]` != 0 (set by nonfinite_flag, the divergence guard on the
// device) skips the update, as the host guard's error does eagerly.
extern "C" __global__ void sgd_update_dev(float* __restrict__ param,
                                          const float* __restrict__ grad,
                                          float* __restrict__ momentum_buf,
                                          long long n, const double* lr,
                                          double momentum, double dampening,
                                          double weight_decay, int nesterov,
                                          int first_step, const int* diverged)
{
    if (diverged[0]) return;
    sgd_body(param, grad, momentum_buf, n, lr[0], momentum, dampening,
             weight_decay, nesterov, first_step);
}

// torch.optim.Adam step (amsgrad=False, maximize=False, L2 weight decay, i.e.
// not AdamW), for one parameter tensor; `step` is the 1-based step count
// AFTER incrementing (1 on the first call). m and v start as zeros.
//     g   = grad + weight_decay * param                (if weight_decay != 0)
//     m   = lerp(m, g, 1 - beta1)                       (= beta1*m + (1-beta1)*g)
//     v   = beta2 * v + (1 - beta2) * g * g
//     bias_correction1 = 1 - beta1^step,  bias_correction2 = 1 - beta2^step
//     denom = sqrt(v) / sqrt(bias_correction2) + eps
//     param -= lr / bias_correction1 * m / denom
// lerp uses torch's two-sided formula (exact at weight 0 and 1).
static __device__ __forceinline__ void
adam_body(float* __restrict__ param, const float* __restrict__ grad,
          float* __restrict__ m, float* __restrict__ v, long long n, double lr,
          double beta1, double beta2, double eps, double weight_decay, int step)
{
    const double bias_correction1 = 1.0 - pow(beta1, (double)step);
    const double bias_correction2 = 1.0 - pow(beta2, (double)step);
    const float neg_step_size = (float)(-(lr / bias_correction1));
    const float bc2_sqrt = (float)sqrt(bias_correction2);
    const float w1 = (float)(1.0 - beta1);  // lerp weight
    const float b2 = (float)beta2;
    const float one_minus_b2 = (float)(1.0 - beta2);
    const float eps_f = (float)eps;
    const float wd = (float)weight_decay;
    const bool use_wd = (weight_decay != 0.0);

    GRID_STRIDE_LOOP(i, n)
    {
        const float p = param[i];
        float g = grad[i];
        if (use_wd) g = g + wd * p;

        // m.lerp_(g, w1), torch's formula
        float mi = m[i];
        const float diff = g - mi;
        mi = (w1 < 0.5f) ? mi + w1 * diff : g - diff * (1.0f - w1);
        m[i] = mi;

        // v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        float vi = v[i] * b2;
        vi = vi + one_minus_b2 * g * g;
        v[i] = vi;

        // param.addcdiv_(m, sqrt(v) / sqrt(bc2) + eps, value=-lr / bc1)
        const float denom = sqrtf(vi) / bc2_sqrt + eps_f;
        param[i] = p + neg_step_size * (mi / denom);
    }
}

extern "C" __global__ void adam_update(float* __restrict__ param,
                                       const float* __restrict__ grad,
                                       float* __restrict__ m,
                                       float* __restrict__ v, long long n,
                                       double lr, double beta1, double beta2,
                                       double eps, double weight_decay,
                                       int step)
{
    adam_body(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step);
}

// The same step with `scalars` = {lr, step} read from device memory (step as
// a double: exact up to 2^53): a CUDA graph's replay (minidl/runtime/capture.py),
// where the bias corrections change at every step; skipped if `diverged[0]`.
extern "C" __global__ void adam_update_dev(float* __restrict__ param,
                                           const float* __restrict__ grad,
                                           float* __restrict__ m,
                                           float* __restrict__ v, long long n,
                                           const double* scalars, double beta1,
                                           double beta2, double eps,
                                           double weight_decay,
                                           const int* diverged)
{
    if (diverged[0]) return;
    adam_body(param, grad, m, v, n, scalars[0], beta1, beta2, eps,
              weight_decay, (int)scalars[1]);
}
