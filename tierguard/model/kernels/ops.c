/* Small fused row-wise ops of a decode layer: one call instead of several torch ops. */
#include "tg_kernels.h"

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of `dim` floats (contiguous). With
 * `residual` non-NULL first residual[r] += x[r] and the sum is normalised (the decoder's
 * `h = x + attn; norm(h)`). Same arithmetic order as transformers' float32 RMSNorm. */
inline void rms_row(const float *in, float *res, const float *w, float *o, int64_t dim, float eps) {
    if (res) {
        for (int64_t d = 0; d < dim; d++) res[d] += in[d];
        in = res;
    }
    float ss = 0.f;
    for (int64_t d = 0; d < dim; d++) ss += in[d] * in[d];
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (in[d] * inv);
}

void tg_rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                 float eps) {
    for (int64_t r = 0; r < rows; r++)
        rms_row(x + r * dim, residual ? residual + r * dim : NULL, w, out + r * dim, dim, eps);
}

/* out[r, j] = silu(gu[r, j]) * gu[r, inter + j]: the fused gate/up projection's activation. */
inline void silu_row(const float *g, float *o, int64_t inter) {
    const float *u = g + inter;
    for (int64_t j = 0; j < inter; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
}

void tg_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) silu_row(gu + r * 2 * inter, out + r * inter, inter);
}
