/* Weight-only float32 / int8 / int4 matmuls for few activation rows (decode).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for M <= TG_MAX_M activation rows, with w quantized:
 *   int8: w[n, k] = q[n, k] * scale[n, k / 32],              q: int8 [N, K], scale float16
 *         [N, ceil(K / 32)] (GGUF Q8_0's blocks; a shorter last group when 32 does not divide K)
 *   int4: w[n, k] = q * scale[n, g] + lo[n, g], g = k / G,   q: 4 bits, 0..15,
 *         scale and lo float16
 *         (GGUF Q4_1's layout: in group g of row n, byte j of the G/2 bytes holds
 *          element j in its low nibble and element j + G/2 in its high nibble)
 * Each weight byte is read once and widened in registers; all M rows use it. With few
 * rows this is bound by memory bandwidth, which is the point of quantizing. Rows of y
 * are split over the OpenMP threads. More rows than TG_MAX_M go in chunks of TG_MAX_M
 * over each 16-row weight block while it is in cache, or through a widened block
 * (gemv_widened, tiles.c).
 */
#include "tg_kernels.h"

/* 8 int8 -> 8 floats; 8 bytes -> their 8 low and 8 high nibbles as floats. x86 AVX2
 * intrinsics where the compiler targets them (GCC scalarises the generic conversion),
 * plain loops elsewhere. */
#if defined(__AVX2__)
static inline v8 i8_to_f32(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void u4_to_f32(const uint8_t *p, v8 *lo, v8 *hi) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), mask = _mm_set1_epi8(15);
    *lo = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, mask)));
    *hi = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
/* A 32-value group in GGUF order: 16 bytes, low nibbles = values 0..15, high = 16..31. */
static inline void u4x32_to_f32(const uint8_t *p, v8 *q0, v8 *q1, v8 *q2, v8 *q3) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    *q0 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    *q1 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    *q2 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    *q3 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#else
static inline void u4x32_to_f32(const uint8_t *p, v8 *q0, v8 *q1, v8 *q2, v8 *q3) {
    for (int i = 0; i < 8; i++) {
        (*q0)[i] = (float)(p[i] & 15);
        (*q1)[i] = (float)(p[i + 8] & 15);
        (*q2)[i] = (float)(p[i] >> 4);
        (*q3)[i] = (float)(p[i + 8] >> 4);
    }
}
static inline v8 i8_to_f32(const int8_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) r[i] = (float)p[i];
    return r;
}
static inline void u4_to_f32(const uint8_t *p, v8 *lo, v8 *hi) {
    for (int i = 0; i < 8; i++) {
        (*lo)[i] = (float)(p[i] & 15);
        (*hi)[i] = (float)(p[i] >> 4);
    }
}
#endif

/* The int8 row loop's vector: 16 floats where the compiler targets AVX-512 (one
 * conversion and one FMA per 16 weights instead of two), else 8. Why: with 8-float
 * vectors an int8 decode row is bound by its convert-and-FMA chain, not by memory.
 * The int4 rows of GGUF's 32-weight block take the same width (gemv_int4_rows). */
#if defined(__AVX512F__)
typedef float vw __attribute__((vector_size(64)));
static inline vw loadw(const float *p) { return (vw)_mm512_loadu_ps(p); }
static inline vw i8x16_to_f32(const int8_t *p) {
    return (vw)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline float hsumw(vw x) { return _mm512_reduce_add_ps((__m512)x); }
#else
typedef v8 vw;
static inline float hsumw(vw x) { return hsum8(x); }
#endif

/* U independent accumulators per activation row hide the FMA latency (a single chain
 * of dependent FMAs would bound the loop at one FMA per 4 cycles); fewer rows, more U,
 * so rows x U stays within the 16 vector registers. */
#define TG_UNROLL(M) ((M) == 1 ? 4 : (M) <= 3 ? 2 : 1)

static inline float half_to_float(uint16_t h);

/* One int8 group of 32 weights against M activation rows: per row, the 32 products are
 * summed in registers and multiplied by the group's scale once, into acc[m * U]. */
static inline void int8_group(const int8_t *wg, float s, const float *xg, int M, int64_t K, vw *acc, int U) {
#if defined(__AVX512F__)
    const vw q0 = i8x16_to_f32(wg), q1 = i8x16_to_f32(wg + 16);
    for (int m = 0; m < M; m++) {
        const float *xm = xg + m * K;
        acc[m * U] += s * (q0 * loadw(xm) + q1 * loadw(xm + 16));
    }
#else
    const v8 q0 = i8_to_f32(wg), q1 = i8_to_f32(wg + 8), q2 = i8_to_f32(wg + 16), q3 = i8_to_f32(wg + 24);
    for (int m = 0; m < M; m++) {
        const float *xm = xg + m * K;
        acc[m * U] += s * ((q0 * load8(xm) + q1 * load8(xm + 8)) + (q2 * load8(xm + 16) + q3 * load8(xm + 24)));
    }
#endif
}

/* int8 in groups of 32 along K (GGUF Q8_0's block), one float16 scale per group. With few
 * activation rows, U groups per iteration feed U accumulators per row (TG_UNROLL: a
 * single chain of dependent FMAs would bound the loop). A K that is not a multiple of 32 ends in a
 * shorter group with its own scale (scalar loop). */
inline void gemv_int8_rows(const float *x, int M, int64_t K, const int8_t *w, const uint16_t *scale,
                                  int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int U = TG_UNROLL(M);
    const int64_t full = K / 32, ng = (K + 31) / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * K;
        const uint16_t *sr = scale + n * ng;
        vw acc[TG_MAX_M * 4];
        for (int i = 0; i < M * U; i++) acc[i] = (vw){0};
        int64_t g = 0;
        for (; g + U <= full; g += U)
            for (int u = 0; u < U; u++)
                int8_group(wr + (g + u) * 32, half_to_float(sr[g + u]), x + (g + u) * 32, M, K, acc + u, U);
        for (; g < full; g++) /* the groups left over by U */
            int8_group(wr + g * 32, half_to_float(sr[g]), x + g * 32, M, K, acc, U);
        for (int m = 0; m < M; m++) {
            vw t = acc[m * U];
            for (int u = 1; u < U; u++) t += acc[m * U + u];
            float sum = hsumw(t);
            if (full < ng) {
                float part = 0.f;
                for (int64_t k = full * 32; k < K; k++) part += x[m * K + k] * (float)wr[k];
                sum += half_to_float(sr[full]) * part;
            }
            y[m * ldy + n] = sum;
        }
    }
}

/* float32 weights: the same loop without the widening. Why not torch's GEMV: for one
 * row on small layer shapes it reads well below the memory bandwidth this loop reaches
 * (that of llama.cpp's f32 path). */
inline void gemv_f32_rows(const float *x, int M, int64_t K, const float *w, int64_t n0, int64_t n1,
                                 float *y, int64_t ldy) {
    const int U = TG_UNROLL(M);
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = w + n * K;
        v8 acc[TG_MAX_M * 4];
        for (int i = 0; i < M * U; i++) acc[i] = (v8){0};
        int64_t k = 0;
        for (; k + 8 * U <= K; k += 8 * U) {
            for (int u = 0; u < U; u++) {
                const v8 wf = load8(wr + k + 8 * u);
                for (int m = 0; m < M; m++) acc[m * U + u] += wf * load8(x + m * K + k + 8 * u);
            }
        }
        for (; k + 8 <= K; k += 8) {
            const v8 wf = load8(wr + k);
            for (int m = 0; m < M; m++) acc[m * U] += wf * load8(x + m * K + k);
        }
        for (int m = 0; m < M; m++) {
            v8 t = acc[m * U];
            for (int u = 1; u < U; u++) t += acc[m * U + u];
            float s = hsum8(t);
            for (int64_t kk = k; kk < K; kk++) s += x[m * K + kk] * wr[kk];
            y[m * ldy + n] = s;
        }
    }
}

/* IEEE half -> float (int8 scales, int4 scales and mins are stored as float16: GGUF's own width). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

inline void gemv_int4_rows(const float *x, int M, int64_t K, const uint8_t *w, const uint16_t *scale,
                                  const uint16_t *lo, int64_t G, const float *xsum, int64_t n0, int64_t n1,
                                  float *y, int64_t ldy) {
    const int64_t ng = K / G, half = G / 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * (K / 2);
        v8 acc[TG_MAX_M], acc2[TG_MAX_M];
        float lacc[TG_MAX_M];
        for (int m = 0; m < M; m++) {
            acc[m] = acc2[m] = (v8){0};
            lacc[m] = 0.f;
        }
#if defined(__AVX512F__)
        if (G == 32) { /* as below, 16 weights per vector: low nibbles 0..15, high 16..31 */
            vw a0[TG_MAX_M], a1[TG_MAX_M];
            for (int m = 0; m < M; m++) a0[m] = a1[m] = (vw){0};
            const __m128i mask = _mm_set1_epi8(15);
            for (int64_t g = 0; g < ng; g++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(wr + g * 16));
                const float s = half_to_float(scale[n * ng + g]), l = half_to_float(lo[n * ng + g]);
                const vw q0 = (vw)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))) * s;
                const vw q1 = (vw)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))) * s;
                for (int m = 0; m < M; m++) {
                    const float *xg = x + m * K + g * 32;
                    a0[m] += q0 * loadw(xg);
                    a1[m] += q1 * loadw(xg + 16);
                    lacc[m] += l * xsum[m * ng + g];
                }
            }
            for (int m = 0; m < M; m++) y[m * ldy + n] = hsumw(a0[m] + a1[m]) + lacc[m];
            continue;
        }
#endif
        if (G == 32) { /* GGUF's block: 16 bytes at once, the scale folded into the weights */
            for (int64_t g = 0; g < ng; g++) {
                v8 q0, q1, q2, q3;
                u4x32_to_f32(wr + g * 16, &q0, &q1, &q2, &q3);
                const float s = half_to_float(scale[n * ng + g]), l = half_to_float(lo[n * ng + g]);
                q0 *= s, q1 *= s, q2 *= s, q3 *= s;
                for (int m = 0; m < M; m++) {
                    const float *xg = x + m * K + g * 32;
                    acc[m] += q0 * load8(xg) + q1 * load8(xg + 8);
                    acc2[m] += q2 * load8(xg + 16) + q3 * load8(xg + 24);
                    lacc[m] += l * xsum[m * ng + g];
                }
            }
            for (int m = 0; m < M; m++) y[m * ldy + n] = hsum8(acc[m] + acc2[m]) + lacc[m];
            continue;
        }
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *b = wr + g * half;
            v8 pl[TG_MAX_M], ph[TG_MAX_M]; /* low and high nibbles: two FMA chains */
            for (int m = 0; m < M; m++) pl[m] = ph[m] = (v8){0};
            for (int64_t j = 0; j < half; j += 8) {
                v8 ql, qh;
                u4_to_f32(b + j, &ql, &qh);
                for (int m = 0; m < M; m++) {
                    const float *xg = x + m * K + g * G + j;
                    pl[m] += ql * load8(xg);
                    ph[m] += qh * load8(xg + half);
                }
            }
            const float s = half_to_float(scale[n * ng + g]), l = half_to_float(lo[n * ng + g]);
            for (int m = 0; m < M; m++) {
                acc[m] += s * (pl[m] + ph[m]);
                lacc[m] += l * xsum[m * ng + g];
            }
        }
        for (int m = 0; m < M; m++) y[m * ldy + n] = hsum8(acc[m]) + lacc[m];
    }
}

/* One weight row n as float32 into o [K]: the int8 and int4 layouts of qlinear.py. */
static inline void dq_int8_row(const int8_t *w, const uint16_t *scale, int64_t K, int64_t n, float *o) {
    const int64_t ng = (K + 31) / 32;
    const int8_t *wr = w + n * K;
    for (int64_t g = 0; g < ng; g++) {
        const float s = half_to_float(scale[n * ng + g]);
        const int64_t k1 = g * 32 + 32 < K ? g * 32 + 32 : K;
        int64_t k = g * 32;
        for (; k + 8 <= k1; k += 8) *(v8 *)(o + k) = i8_to_f32(wr + k) * s;
        for (; k < k1; k++) o[k] = (float)wr[k] * s;
    }
}

static inline void dq_int4_row(const uint8_t *w, const uint16_t *scale, const uint16_t *lo, int64_t K, int64_t G,
                               int64_t n, float *o) {
    const int64_t ng = K / G, half = G / 2;
    for (int64_t g = 0; g < ng; g++, o += G) {
        const uint8_t *b = w + n * (K / 2) + g * half;
        const float s = half_to_float(scale[n * ng + g]), l = half_to_float(lo[n * ng + g]);
        for (int64_t j = 0; j < half; j += 8) {
            v8 ql, qh;
            u4_to_f32(b + j, &ql, &qh);
            *(v8 *)(o + j) = ql * s + l;
            *(v8 *)(o + j + half) = qh * s + l;
        }
    }
}

/* More than TG_MAX_M activation rows (a large decode batch, a mixed step): the block's
 * (<= 16) weight rows are widened once into this thread's float buffer, which stays in
 * L2, and the float32 register tiles (tiles.c) run over it. Why: widening the quantized
 * bytes again for each chunk of TG_MAX_M rows (the few-rows path) makes a many-row
 * quantized step markedly slower than a float32 one. The buffer lives as long as the
 * thread (OpenMP's pool keeps its threads). */
/* int8 blocks are widened from this many rows; below it the row loop runs in chunks of
 * TG_MAX_M (8 + the rest) over the block while it is in cache. Why: for a few rows more
 * than 8, widening costs more than a second chunk; from about this count on it is as
 * fast or faster (one conversion for all rows). int4 widens from 9: its nibble unpacking
 * costs more per chunk. */
#define TG_WIDEN_INT8_FROM 13
static __thread float *tg_wbuf;
static __thread int64_t tg_wbuf_len;

/* Returns 0 (done) or -1 (too few rows: TG_MAX_M for int4, fewer than
 * TG_WIDEN_INT8_FROM for int8; or no buffer: the caller takes the few-rows path, which
 * widens in registers). */
int gemv_widened(const float *x, int64_t M_all, int64_t K, const int8_t *w8, const uint8_t *w4,
                        const uint16_t *scale, const uint16_t *lo, int64_t G, int64_t n0, int64_t n1, float *y,
                        int64_t ldy) {
    if (M_all <= (w8 ? TG_WIDEN_INT8_FROM - 1 : TG_MAX_M)) return -1;
    float *buf = tg_thread_buffer(&tg_wbuf, &tg_wbuf_len, (n1 - n0) * K);
    if (!buf) return -1;
    for (int64_t n = n0; n < n1; n++) {
        if (w8)
            dq_int8_row(w8, scale, K, n, buf + (n - n0) * K);
        else
            dq_int4_row(w4, scale, lo, K, G, n, buf + (n - n0) * K);
    }
    gemm_f32_tiled(x, M_all, K, buf, n1 - n0, y + n0, ldy);
    return 0;
}

/* Returns 0, or -1 for shapes the kernel does not take (the caller uses torch then). */
int tg_gemv_int8(const float *x, int64_t M_all, int64_t K, const int8_t *w, const uint16_t *scale, int64_t N,
                 float *y, int64_t ldy) {
    if (M_all < 1 || M_all > TG_MAX_BATCH) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
        if (gemv_widened(x, M_all, K, w, NULL, scale, NULL, 32, n0, n1, y, ldy))
            TG_CHUNKS(gemv_int8_rows(x + m0 * K, M, K, w, scale, n0, n1, y + m0 * ldy, ldy))
    }
    return 0;
}

int tg_gemv_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int64_t ldy) {
    if (M < 1 || M > TG_MAX_M) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
        TG_SPLIT(gemv_f32_rows(x, M, K, w, n0, n1, y, ldy))
    }
    return 0;
}

int tg_gemv_int4(const float *x, int64_t M_all, int64_t K, const uint8_t *w, const uint16_t *scale,
                 const uint16_t *lo, int64_t G, int64_t N, float *y, int64_t ldy) {
    if (M_all < 1 || M_all > TG_MAX_BATCH || G % 16 != 0 || K % G != 0) return -1;
    const int64_t ng = K / G;
    float *xsum = malloc(sizeof(float) * M_all * ng); /* sum of x over each group: the lo term */
    if (!xsum) return -1;
    for (int64_t m = 0; m < M_all; m++)
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t j = 0; j < G; j++) s += x[m * K + g * G + j];
            xsum[m * ng + g] = s;
        }
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
        if (gemv_widened(x, M_all, K, NULL, w, scale, lo, G, n0, n1, y, ldy))
            TG_CHUNKS(gemv_int4_rows(x + m0 * K, M, K, w, scale, lo, G, xsum + m0 * ng, n0, n1, y + m0 * ldy, ldy))
    }
    free(xsum);
    return 0;
}

/* Rows [r0, r1) of the weight as float32 into out [(r1 - r0), K]: for many activation
 * rows (prefill) the caller multiplies such blocks with torch's GEMM instead. */
void tg_dequant_int8(const int8_t *w, const uint16_t *scale, int64_t K, int64_t r0, int64_t r1, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = r0; n < r1; n++) dq_int8_row(w, scale, K, n, out + (n - r0) * K);
}

/* int8 quantization with a scale search (qlinear.quantize_int8), rows [N, K] float32 in
 * groups of 32: for each group, of the J candidate scales cand[group * J + j] (float16
 * values, made by the caller) the one whose rounded q has the least squared error is
 * chosen; writes q [N, K] and its index best[group]. A K that 32 does not divide ends in
 * a shorter group. */
void tg_quantize_int8(const float *w, int64_t N, int64_t K, const float *cand, int64_t J, int8_t *q, uint8_t *best) {
    const int64_t ng = (K + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N * ng; i++) {
        const int64_t n = i / ng, k0 = (i % ng) * 32, len = K - k0 < 32 ? K - k0 : 32;
        const float *x = w + n * K + k0;
        float best_err = FLT_MAX;
        int64_t bj = 0;
        for (int64_t j = 0; j < J; j++) {
            const float s = cand[i * J + j];
            float err = 0.f;
            for (int64_t t = 0; t < len; t++) {
                float r = s > 0.f ? nearbyintf(x[t] / s) : 0.f;
                r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
                const float e = r * s - x[t];
                err += e * e;
            }
            if (err < best_err) best_err = err, bj = j;
        }
        const float s = cand[i * J + bj];
        for (int64_t t = 0; t < len; t++) {
            const float r = s > 0.f ? nearbyintf(x[t] / s) : 0.f;
            q[n * K + k0 + t] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        }
        best[i] = (uint8_t)bj;
    }
}

void tg_dequant_int4(const uint8_t *w, const uint16_t *scale, const uint16_t *lo, int64_t K, int64_t G, int64_t r0,
                     int64_t r1, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = r0; n < r1; n++) dq_int4_row(w, scale, lo, K, G, n, out + (n - r0) * K);
}
