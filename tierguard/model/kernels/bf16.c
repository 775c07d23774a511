/* bfloat16 weights in panels, float32 activations rounded to bfloat16 at each matmul.
 *
 * y[m, n] = sum_k bf16(x[m, k]) * w[n, k], summed in float32. Why: a step of many rows
 * (prefill chunks beside decodes) is bound by arithmetic, and AVX512-BF16's dot product
 * (vdpbf16ps) does twice the multiply-adds of a float32 FMA per instruction, from half
 * the weight bytes. The residual stream, norms and attention stay float32; only the
 * inputs of the matmuls are rounded.
 *
 * Panel layout (qlinear.Bf16Linear packs and holds it): the weight's rows in panels of
 * TG_BF16_NR (32); within panel p, for each pair of inputs kp, the 32 rows' two values
 * side by side:
 *   packed[(p * Kh + kp) * 64 + j * 2 + t] = bf16(w[32 p + j, 2 kp + t])
 * with Kh = ceil(K / 2); rows past N and the input past an odd K are zero. One 64-byte
 * load is 16 rows x 2 inputs, the operand vdpbf16ps takes against a broadcast pair of
 * one activation row; a register tile of TG_BF16_MR rows x 2 panels keeps 24
 * accumulators, 4 weight vectors and one broadcast in the 32 vector registers.
 *
 * Without AVX512-BF16 (chosen when the library is compiled, i.e. for the CPU it runs on)
 * the same layout is widened to float32 in registers (a bfloat16 is the high half of a
 * float32) and multiplied with FMAs: the same products, summed in another order.
 */
#include "tg_kernels.h"

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; the model has no NaNs */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rows [m0, m1) of x (float32, row stride K) as bfloat16 rows of kh pairs. */
void bf16_rows(const float *x, int64_t m0, int64_t m1, int64_t K, uint16_t *xb) {
    const int64_t kp = 2 * ((K + 1) / 2);
    for (int64_t m = m0; m < m1; m++) {
        const float *src = x + m * K;
        uint16_t *dst = xb + m * kp;
        int64_t k = 0;
#if defined(__AVX512BF16__)
        for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
#endif
        for (; k < K; k++) dst[k] = f32_to_bf16(src[k]);
        if (kp > K) dst[K] = 0;
    }
}

#if defined(__AVX512BF16__)
#define TG_BF16_MR 6
/* A tile: M (<= 6) activation rows x NP (1 or 2) panels; out [M][64] (columns of the
 * second panel at 32..63). */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t ldx, const int M, const int NP,
                                                           const uint16_t *w, int64_t pstride, int64_t Kh, float *out,
                                                           const uint16_t *pf, int64_t pf0, int64_t pf1) {
    __m512 c[TG_BF16_MR][4];
    int64_t line = pf0 * 4 / (pf1 > 0 ? pf1 : 1), credit = pf0 * 4 % (pf1 > 0 ? pf1 : 1);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 2 * NP; j++) c[m][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kh; kp++) {
        if (pf) /* the next panels' 4 Kh lines, spread evenly over the pf1 tiles: 4 / pf1 per iteration */
            for (credit += 4; credit >= pf1; credit -= pf1, line++)
                _mm_prefetch((const char *)(pf + ((line & 3) >> 1) * pstride + (line >> 2) * 64 + (line & 1) * 32),
                             _MM_HINT_T0);
        __m512bh b[4];
        for (int q = 0; q < NP; q++) {
            b[2 * q] = (__m512bh)_mm512_loadu_si512(w + q * pstride + kp * 64);
            b[2 * q + 1] = (__m512bh)_mm512_loadu_si512(w + q * pstride + kp * 64 + 32);
        }
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < 2 * NP; j++) c[m][j] = _mm512_dpbf16_ps(c[m][j], a, b[j]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 2 * NP; j++) _mm512_storeu_ps(out + m * 64 + 16 * j, c[m][j]);
}
#else
#define TG_BF16_MR 4
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* The portable tile: 8 weight rows at a time, each pair widened to two float32 vectors. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t ldx, const int M, const int NP,
                                                           const uint16_t *w, int64_t pstride, int64_t Kh, float *out,
                                                           const uint16_t *pf, int64_t pf0, int64_t pf1) {
    (void)pf, (void)pf0, (void)pf1; /* hardware prefetch only */
    for (int j = 0; j < 4 * NP; j++) {
        const uint16_t *wj = w + (j / 4) * pstride + (j % 4) * 16;
        v8 acc[TG_BF16_MR];
        for (int m = 0; m < M; m++) acc[m] = (v8){0};
        for (int64_t kp = 0; kp < Kh; kp++) {
            const v8u u = *(const v8u *)(wj + kp * 64);
            const v8 we = (v8)(u << 16), wo = (v8)(u & 0xffff0000u);
            for (int m = 0; m < M; m++) {
                const float xe = bf16_to_f32(x[m * ldx + 2 * kp]), xo = bf16_to_f32(x[m * ldx + 2 * kp + 1]);
                acc[m] += xe * we + xo * wo;
            }
        }
        for (int m = 0; m < M; m++) *(v8 *)(out + m * 64 + 8 * j) = acc[m];
    }
}
#endif

#define TG_BF16_TILE(MM, NP) bf16_tile(xb + m0 * kpad, kpad, MM, NP, w + p * pstride, pstride, Kh, c, pf, pf0, pf1)

/* Panels [p0, p1) of y [M, N] (row stride ldy) from the bfloat16 rows xb [M][2 Kh]:
 * panels in pairs (a single one at the end), all row tiles under each, so a pair's
 * weights are read from memory once and from cache for the other tiles. Each tile
 * prefetches its share of the next pair into L2. Why: weights larger than the caches
 * (a model's layers) stream from memory, and without it the first tile of each pair
 * stalls on them while the others run from cache (a step of 32 rows ran at two thirds
 * of the in-cache rate). */
void bf16_panels(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t p0, int64_t p1,
                 float *y, int64_t ldy) {
    const int64_t Kh = (K + 1) / 2, kpad = 2 * Kh, pstride = Kh * 64;
    float c[TG_BF16_MR * 64];
    for (int64_t p = p0; p < p1; p += 2) {
        const int NP = p + 1 < p1 ? 2 : 1;
        const int64_t n0 = p * TG_BF16_NR, cols = (N - n0 < NP * TG_BF16_NR) ? N - n0 : NP * TG_BF16_NR;
        const int64_t tiles = (M + TG_BF16_MR - 1) / TG_BF16_MR;
        const uint16_t *pf = p + 3 < p1 ? w + (p + 2) * pstride : NULL; /* the next pair, if a pair */
        for (int64_t m0 = 0; m0 < M; m0 += TG_BF16_MR) {
            const int rows = M - m0 < TG_BF16_MR ? (int)(M - m0) : TG_BF16_MR;
            const int64_t pf0 = m0 / TG_BF16_MR * Kh, pf1 = tiles;
            if (NP == 2) {
                switch (rows) {
                case 1: TG_BF16_TILE(1, 2); break;
                case 2: TG_BF16_TILE(2, 2); break;
                case 3: TG_BF16_TILE(3, 2); break;
#if TG_BF16_MR > 4
                case 4: TG_BF16_TILE(4, 2); break;
                case 5: TG_BF16_TILE(5, 2); break;
#endif
                default: TG_BF16_TILE(TG_BF16_MR, 2); break;
                }
            } else {
                switch (rows) {
                case 1: TG_BF16_TILE(1, 1); break;
                case 2: TG_BF16_TILE(2, 1); break;
                case 3: TG_BF16_TILE(3, 1); break;
#if TG_BF16_MR > 4
                case 4: TG_BF16_TILE(4, 1); break;
                case 5: TG_BF16_TILE(5, 1); break;
#endif
                default: TG_BF16_TILE(TG_BF16_MR, 1); break;
                }
            }
            for (int m = 0; m < rows; m++) memcpy(y + (m0 + m) * ldy + n0, c + m * 64, sizeof(float) * cols);
        }
    }
}

/* This thread's share [*a, *b) of n items (call inside a parallel region). */
void tg_thread_share(int64_t n, int64_t *a, int64_t *b) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *a = n * t / nt;
    *b = n * (t + 1) / nt;
}

/* y [M, N] (row stride ldy) = bf16(x [M, K]) . w^T over the packed weight. Returns 0, or
 * -1 when the rows' bfloat16 copy cannot be allocated. */
int tg_gemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int64_t ldy) {
    if (M < 1) return 0;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * 2 * ((K + 1) / 2)));
    if (!xb) return -1;
    const int64_t panels = (N + TG_BF16_NR - 1) / TG_BF16_NR;
#pragma omp parallel
    {
        int64_t a, b;
        tg_thread_share(M, &a, &b);
        bf16_rows(x, a, b, K, xb);
#pragma omp barrier
        tg_thread_share(panels, &a, &b);
        bf16_panels(xb, M, K, w, N, a, b, y, ldy);
    }
    free(xb);
    return 0;
}
