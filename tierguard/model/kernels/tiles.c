/* Float32 register tiles for many activation rows. */
#include "tg_kernels.h"

/* Many activation rows (more than TG_MAX_M) against float32 weight rows: register tiles
 * of 4 activation rows x 3 weight rows, so each loaded vector feeds several FMAs. The
 * row-at-a-time loop (gemv.c) loads one x vector per FMA: two loads a cycle then cap it
 * near one FMA a cycle, half of what the FMA units give. The tile is 12 accumulators
 * (enough chains to hide the FMA latency) + 3 weight vectors + 1 x vector: the 16 ymm
 * registers, named one by one (an array of them is spilled to the stack). Tiles walk
 * the weight rows inside each group of 4 activation rows, so those rows stay in L1.
 * Edges take the row loop. */
static inline float tail_dot(const float *x, const float *w, int64_t k, int64_t K) {
    float s = 0.f;
    for (; k < K; k++) s += x[k] * w[k];
    return s;
}

/* Keeps a loaded vector in a register: without it GCC folds the load into every FMA
 * that uses it (one load per FMA again). */
#if defined(__GNUC__) && defined(__AVX__)
#define TG_IN_REG(v) __asm__("" : "+x"(v))
#else
#define TG_IN_REG(v) (void)0
#endif

static void tile_f32_4x3(const float *x, int64_t K, const float *w, float *y, int64_t ldy) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K;
    v8 a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
    v8 a20 = {0}, a21 = {0}, a22 = {0}, a30 = {0}, a31 = {0}, a32 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8 b0 = load8(w0 + k), b1 = load8(w1 + k), b2 = load8(w2 + k);
        TG_IN_REG(b0);
        TG_IN_REG(b1);
        TG_IN_REG(b2);
        v8 xv = load8(x0 + k);
        TG_IN_REG(xv);
        a00 += xv * b0, a01 += xv * b1, a02 += xv * b2;
        xv = load8(x1 + k);
        TG_IN_REG(xv);
        a10 += xv * b0, a11 += xv * b1, a12 += xv * b2;
        xv = load8(x2 + k);
        TG_IN_REG(xv);
        a20 += xv * b0, a21 += xv * b1, a22 += xv * b2;
        xv = load8(x3 + k);
        TG_IN_REG(xv);
        a30 += xv * b0, a31 += xv * b1, a32 += xv * b2;
    }
    const v8 acc[12] = {a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            y[i * ldy + j] = hsum8(acc[i * 3 + j]) + tail_dot(x + i * K, w + j * K, k, K);
}

/* y[m, j] = x[m] . w[j] for M activation rows and N weight rows (float32, rows of K). */
void gemm_f32_tiled(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int64_t ldy) {
    const int64_t M4 = M / 4 * 4, N3 = N / 3 * 3;
    for (int64_t m0 = 0; m0 < M4; m0 += 4) {
        for (int64_t n0 = 0; n0 < N3; n0 += 3) tile_f32_4x3(x + m0 * K, K, w + n0 * K, y + m0 * ldy + n0, ldy);
        if (N3 < N) {
            const int M = 4;
            gemv_f32_rows(x + m0 * K, M, K, w, N3, N, y + m0 * ldy, ldy);
        }
    }
    if (M4 < M) {
        const int64_t M_all = M - M4;
        TG_CHUNKS(gemv_f32_rows(x + (M4 + m0) * K, M, K, w, 0, N, y + (M4 + m0) * ldy, ldy))
    }
}
