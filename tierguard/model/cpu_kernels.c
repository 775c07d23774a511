/* Decode attention over the paged KV pool, read in place (CPU, float32).
 *
 * Built at first use by tierguard/model/native.py with the system C compiler and loaded
 * with ctypes; without a compiler the engine uses the torch path in attention.py, which
 * computes the same thing from a gathered copy of the blocks.
 *
 * Why: a torch decode step gathers each sequence's blocks into a contiguous copy per
 * layer (read + write + read of the whole context) and spends ~15 small ops per layer
 * on it. Here one call per layer writes the new token's K/V into its slot and attends
 * over the context through the block table: every K and V row is read once, where it is.
 *
 * Pool layout (tierguard/kv/spec.py, blocks first), one layer's view:
 *   element (block, kv_or_v, slot, head, d) at
 *   pool[block * blk_stride + kv_or_v * v_offset + slot * heads_kv * D + head * D + d]
 */
#include <float.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef struct {
    int32_t batch, heads, kv_heads, head_dim, block_size;
    int64_t q_stride;        /* elements between tokens in q, k_new, v_new */
    int64_t k_stride;
    int64_t v_stride;
    int64_t blk_stride;      /* elements between blocks in the pool */
    int64_t v_offset;        /* elements from a block's K to its V */
    int64_t table_stride;    /* int32 entries per block-table row */
    int64_t work_stride;     /* floats per (sequence, kv head, group member) score row */
    float scale;             /* 1 / sqrt(head_dim) */
    const float *q;          /* token b, head h at q[b * q_stride + h * head_dim] */
    const float *k_new;      /* token b, kv head h at k_new[b * k_stride + h * head_dim] */
    const float *v_new;
    float *pool;             /* the layer's view base: kv_cache[0, layer, 0, 0, 0, 0] */
    const int32_t *tables;   /* [rows, table_stride] block ids */
    const int32_t *rows;     /* [batch] row of each sequence in `tables` */
    const int32_t *ctx;      /* [batch] context length including the new token */
    float *out;              /* [batch, heads, head_dim] */
    float *work;             /* [batch * heads, work_stride] scores */
} tg_decode_args;

/* Sequence b's new K and V rows of KV heads [h0, h1) into its slot of the pool. */
static void store_heads(const tg_decode_args *a, int b, int h0, int h1) {
    const int D = a->head_dim, bs = a->block_size;
    const int32_t slot = a->ctx[b] - 1;
    const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
    float *dst = a->pool + (int64_t)table[slot / bs] * a->blk_stride + (int64_t)(slot % bs) * a->kv_heads * D;
    const int64_t off = (int64_t)h0 * D, n = (int64_t)(h1 - h0) * D;
    memcpy(dst + off, a->k_new + b * a->k_stride + off, sizeof(float) * n);
    memcpy(dst + a->v_offset + off, a->v_new + b * a->v_stride + off, sizeof(float) * n);
}

static void store_new(const tg_decode_args *a) {
    for (int b = 0; b < a->batch; b++) store_heads(a, b, 0, a->kv_heads);
}

/* 8 floats; loads and stores through it need no alignment. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8 x) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += x[i];
    return s;
}

/* Four horizontal sums at once: out[j] = sum of a_j's lanes. Three hadds and one add
 * instead of four separate reductions (each ~6 shuffles and adds on the critical path). */
static inline void hsum8x4(v8 a0, v8 a1, v8 a2, v8 a3, float *out) {
#if defined(__AVX__)
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
#endif
}

/* q . k over D floats (D a multiple of 8) for four K rows: each q vector loaded once
 * feeds four FMAs. */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int D,
                        float *out) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int d = 0; d < D; d += 8) {
        const v8 qv = *(const v8 *)(q + d);
        a0 += qv * *(const v8 *)(k0 + d);
        a1 += qv * *(const v8 *)(k1 + d);
        a2 += qv * *(const v8 *)(k2 + d);
        a3 += qv * *(const v8 *)(k3 + d);
    }
    hsum8x4(a0, a1, a2, a3, out);
}

static inline float dot1(const float *q, const float *k, int D) {
    float s = 0.f;
    if (D % 8 == 0) {
        v8 a = {0};
        for (int d = 0; d < D; d += 8) a += *(const v8 *)(q + d) * *(const v8 *)(k + d);
        return hsum8(a);
    }
    for (int d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

/* For nh (<= TG_PV_HEADS) query heads sharing a KV head: o_h[0 .. 8) += sum over the
 * block's n slots of p_h[s] * v_s[0 .. 8). Each V vector is loaded once for all nh heads
 * and the accumulators stay in registers for the whole block. Specialised on nh by the
 * switch in pv_heads so the loop over heads unrolls. */
#define TG_PV_HEADS 8
static inline __attribute__((always_inline)) void pv8(const float *p, int64_t ps, const float *v, int64_t row, int n,
                                                      const int nh, v8 *o) {
    v8 acc[TG_PV_HEADS];
    for (int h = 0; h < nh; h++) acc[h] = o[h];
    for (int s = 0; s < n; s++, v += row) {
        const v8 vv = *(const v8 *)v;
        for (int h = 0; h < nh; h++) acc[h] += p[h * ps + s] * vv;
    }
    for (int h = 0; h < nh; h++) o[h] = acc[h];
}

static void pv_heads(const float *p, int64_t ps, const float *v, int64_t row, int n, int nh, v8 *o) {
    switch (nh) {
    case 1: pv8(p, ps, v, row, n, 1, o); break;
    case 2: pv8(p, ps, v, row, n, 2, o); break;
    case 3: pv8(p, ps, v, row, n, 3, o); break;
    case 4: pv8(p, ps, v, row, n, 4, o); break;
    case 5: pv8(p, ps, v, row, n, 5, o); break;
    case 6: pv8(p, ps, v, row, n, 6, o); break;
    case 7: pv8(p, ps, v, row, n, 7, o); break;
    default: pv8(p, ps, v, row, n, 8, o); break;
    }
}

/* attend() for a unit of several KV heads (a whole sequence, when there are at least as
 * many sequences as threads). Slot-major: each slot's K (then V) row of these heads is
 * read once, contiguously, for all of their query heads: with long contexts the unit is
 * bound by memory, and one contiguous stream beat per-KV-head passes like attend()'s
 * (strided reads of a third of each row) by 14-27 % (B=8 x 320 and B=2 x 1024 tokens,
 * SmolLM2). Head dims that are multiples of 8 (all the models we run) take the vector
 * path; others the scalar loops. */
static void attend_slots(const tg_decode_args *a, int b, int h0, int h1) {
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size;
    const int G = a->heads / KV, NQ = (h1 - h0) * G; /* query heads handled here */
    const int L = a->ctx[b];
    const int64_t row = (int64_t)KV * D;
    const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
    const float *qsrc = a->q + (int64_t)b * a->q_stride + (int64_t)h0 * G * D;
    float *scores = a->work + ((int64_t)b * a->heads + (int64_t)h0 * G) * a->work_stride;
    float q[NQ * D], acc[NQ * D], mx[NQ], sum[NQ];
    for (int i = 0; i < NQ * D; i++) {
        q[i] = qsrc[i] * a->scale;
        acc[i] = 0.f;
    }
    for (int i = 0; i < NQ; i++) mx[i] = -FLT_MAX; /* finite: built with -ffast-math */
    const int vec = D % 8 == 0;
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + (int64_t)h0 * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int s = 0; s < n; s++) {
            const float *krow = base + s * row;
            for (int i = 0; i < NQ; i++) {
                const float *k = krow + (i / G) * D, *qi = q + i * D;
                float dot;
                if (vec) {
                    v8 x0 = {0}, x1 = {0};
                    int d = 0;
                    for (; d + 16 <= D; d += 16) {
                        x0 += *(const v8 *)(qi + d) * *(const v8 *)(k + d);
                        x1 += *(const v8 *)(qi + d + 8) * *(const v8 *)(k + d + 8);
                    }
                    if (d < D) x0 += *(const v8 *)(qi + d) * *(const v8 *)(k + d);
                    dot = hsum8(x0 + x1);
                } else {
                    dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qi[d] * k[d];
                }
                scores[(int64_t)i * a->work_stride + j0 + s] = dot;
                if (dot > mx[i]) mx[i] = dot;
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        float *si = scores + (int64_t)i * a->work_stride;
        float s = 0.f;
        const float m = mx[i];
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < L; j++) {
            si[j] = expf(si[j] - m);
            s += si[j];
        }
        sum[i] = s;
    }
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base =
            a->pool + (int64_t)table[j0 / bs] * a->blk_stride + a->v_offset + (int64_t)h0 * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int s = 0; s < n; s++) {
            const float *vrow = base + s * row;
            for (int i = 0; i < NQ; i++) {
                const float p = scores[(int64_t)i * a->work_stride + j0 + s];
                const float *v = vrow + (i / G) * D;
                float *o = acc + i * D;
                if (vec) {
                    for (int d = 0; d < D; d += 8) *(v8 *)(o + d) += p * *(const v8 *)(v + d);
                } else {
                    for (int d = 0; d < D; d++) o[d] += p * v[d];
                }
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        float *o = a->out + ((int64_t)b * a->heads + (int64_t)h0 * G + i) * D;
        const float inv = 1.f / sum[i];
        for (int d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
    }
}

/* One sequence, KV heads [h0, h1) with their G = heads / kv_heads query heads each.
 * A unit of one KV head (fewer sequences than threads: a batch-1 decode; the rows of a
 * step with prefill chunks) is computed here, several heads by attend_slots. Each K and
 * V row of the head comes from memory once for all G query heads: scores four slots at
 * a time (the four K rows stay in L1 while each query head takes its dot products), a
 * softmax per query head, then the V rows weighted into accumulators held in registers,
 * 8 dims x up to TG_PV_HEADS heads per pass. Why: the slot-at-a-time loop spent more on
 * horizontal sums and on reloading the output rows than on the multiply-adds; one decode
 * row's attention over 320 tokens took 3.0 ms of SmolLM2's step (30 layers, 2 cores),
 * 1.5 ms this way (best of 3 runs each). Head dims that are multiples of 8 (all the
 * models we run) take the vector path; others scalar loops. */
static void attend(const tg_decode_args *a, int b, int h0, int h1) {
    if (h1 - h0 > 1) {
        attend_slots(a, b, h0, h1);
        return;
    }
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size;
    const int G = a->heads / KV; /* the query heads of KV head h0 */
    const int L = a->ctx[b];
    const int64_t row = (int64_t)KV * D, ws = a->work_stride, head_off = (int64_t)h0 * D;
    const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
    const float *qsrc = a->q + (int64_t)b * a->q_stride + (int64_t)h0 * G * D;
    float *scores = a->work + ((int64_t)b * a->heads + (int64_t)h0 * G) * ws;
    float *o = a->out + ((int64_t)b * a->heads + (int64_t)h0 * G) * D;
    float q[G * D], inv[G];
    for (int i = 0; i < G * D; i++) q[i] = qsrc[i] * a->scale;
    const int vec = D % 8 == 0;
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *k = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + head_off;
        const int n = L - j0 < bs ? L - j0 : bs;
        int s = 0;
        if (vec)
            for (; s + 4 <= n; s += 4, k += 4 * row)
                for (int g = 0; g < G; g++)
                    dot4(q + g * D, k, k + row, k + 2 * row, k + 3 * row, D, scores + g * ws + j0 + s);
        for (; s < n; s++, k += row)
            for (int g = 0; g < G; g++) scores[g * ws + j0 + s] = dot1(q + g * D, k, D);
    }
    for (int g = 0; g < G; g++) {
        float *si = scores + g * ws;
        float m = -FLT_MAX, sum = 0.f; /* finite: built with -ffast-math */
        for (int j = 0; j < L; j++) m = si[j] > m ? si[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < L; j++) {
            si[j] = expf(si[j] - m);
            sum += si[j];
        }
        inv[g] = 1.f / sum;
    }
    if (vec) {
        for (int g0 = 0; g0 < G; g0 += TG_PV_HEADS) {
            const int nh = G - g0 < TG_PV_HEADS ? G - g0 : TG_PV_HEADS;
            for (int d0 = 0; d0 < D; d0 += 8) {
                v8 acc[TG_PV_HEADS] = {{0}};
                for (int j0 = 0; j0 < L; j0 += bs) {
                    const float *v = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + a->v_offset + head_off + d0;
                    pv_heads(scores + g0 * ws + j0, ws, v, row, L - j0 < bs ? L - j0 : bs, nh, acc);
                }
                for (int h = 0; h < nh; h++) *(v8 *)(o + (int64_t)(g0 + h) * D + d0) = acc[h] * inv[g0 + h];
            }
        }
        return;
    }
    for (int i = 0; i < G * D; i++) o[i] = 0.f; /* scalar: rare head sizes only */
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *v = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + a->v_offset + head_off;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int s = 0; s < n; s++, v += row)
            for (int g = 0; g < G; g++)
                for (int d = 0; d < D; d++) o[g * D + d] += scores[g * ws + j0 + s] * v[d];
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) o[g * D + d] *= inv[g];
}

/* Returns 0, or -1 when the queries (heads x head_dim floats) would not fit the stack
 * buffers' budget. With at least as many sequences as threads each thread takes whole
 * sequences (all heads: one pass over each slot); with fewer, KV heads are split over
 * the threads. */
int tg_decode_attention_f32(const tg_decode_args *a) {
    if ((int64_t)a->heads * a->head_dim > 16384) return -1;
    store_new(a);
    const int KV = a->kv_heads;
    if (a->batch >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int b = 0; b < a->batch; b++) attend(a, b, 0, KV);
    } else {
        const int n = a->batch * KV;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
        for (int i = 0; i < n; i++) attend(a, i / KV, i % KV, i % KV + 1);
    }
    return 0;
}


/* ---- weight-only int8 / int4 matmuls for few rows (decode) ------------------------
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
 * are split over the OpenMP threads.
 */
#include <stdlib.h>

#define TG_MAX_M 8

static inline v8 load8(const float *p) { return *(const v8 *)p; }

/* 8 int8 -> 8 floats; 8 bytes -> their 8 low and 8 high nibbles as floats. x86 AVX2
 * intrinsics where the compiler targets them (GCC scalarises the generic conversion),
 * plain loops elsewhere. */
#if defined(__AVX2__)
#include <immintrin.h>
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
 * conversion and one FMA per 16 weights instead of two), else 8. Why: on 2 Zen 5 vCPUs
 * an int8 decode row cost ~2.2 ms of SmolLM2's step with 8-float vectors (5.1 / 7.0 / 9.8
 * / 21.8 ms for 1 / 2 / 3 / 8 rows), its convert-and-FMA chain being the bound there.
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
static inline void gemv_int8_rows(const float *x, int M, int64_t K, const int8_t *w, const uint16_t *scale,
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

/* float32 weights: the same loop without the widening. torch's GEMV for one row reached
 * about 8.5 GB/s on SmolLM2's layer shapes here, where this reads at the bandwidth that
 * llama.cpp's f32 path gets (its decode step is the number to beat). */
static inline void gemv_f32_rows(const float *x, int M, int64_t K, const float *w, int64_t n0, int64_t n1,
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

static inline void gemv_int4_rows(const float *x, int M, int64_t K, const uint8_t *w, const uint16_t *scale,
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

/* Specialised on M so the inner loops over m unroll. */
#define TG_SPLIT(CALL)                                                                   \
    switch (M) {                                                                         \
    case 1: { const int M = 1; CALL; } break;                                            \
    case 2: { const int M = 2; CALL; } break;                                            \
    case 3: { const int M = 3; CALL; } break;                                            \
    case 4: { const int M = 4; CALL; } break;                                            \
    case 5: { const int M = 5; CALL; } break;                                            \
    case 6: { const int M = 6; CALL; } break;                                            \
    case 7: { const int M = 7; CALL; } break;                                            \
    default: { const int M = 8; CALL; } break;                                           \
    }

/* Up to TG_MAX_BATCH activation rows (a batch of decodes): per block of 16 weight rows,
 * chunks of TG_MAX_M activation rows in turn, so the block is read from memory once and
 * from cache for the later chunks (quantized weights are widened once per chunk). */
#define TG_MAX_BATCH 64
#define TG_CHUNKS(CALL)                                                                  \
    for (int64_t m0 = 0; m0 < M_all; m0 += TG_MAX_M) {                                   \
        const int64_t M = M_all - m0 < TG_MAX_M ? M_all - m0 : TG_MAX_M;                 \
        TG_SPLIT(CALL)                                                                   \
    }

/* Many activation rows (more than TG_MAX_M) against float32 weight rows: register tiles
 * of 4 activation rows x 3 weight rows, so each loaded vector feeds several FMAs. The
 * row-at-a-time loop above loads one x vector per FMA: two loads a cycle then cap it
 * near one FMA a cycle, and a step of 16-32 rows ran at ~24 GFMA/s on 2 Zen 3 vCPUs
 * where the FMA units give ~48. The tile is 12 accumulators (enough chains to hide the
 * FMA latency) + 3 weight vectors + 1 x vector: the 16 ymm registers, named one by one
 * (an array of them was spilled to the stack). Tiles walk the weight rows inside each
 * group of 4 activation rows, so those rows stay in L1. Edges take the row loop. */
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
static void gemm_f32_tiled(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int64_t ldy) {
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
 * L2, and every chunk of TG_MAX_M rows runs the float32 loop over it. Widening the
 * quantized bytes again for each chunk (the few-rows path) made a 32-row int4 step
 * ~1.4x a float32 one (SmolLM2, 2 cores). The buffer lives as long as the thread
 * (OpenMP's pool keeps its threads). */
/* int8 blocks are widened from this many rows; below it the row loop runs in chunks of
 * TG_MAX_M (8 + the rest) over the block while it is in cache. Widening at 9 rows made a
 * step of one row more than 8 cost ~1.3x the 8-row step (SmolLM2 int8, 2 cores, fused
 * steps of 2 decodes + 7 prompt tokens: 40.6-41.1 ms against 30.0-30.6 at 8 rows; in
 * chunks 35.6-36.7). From ~13 rows widening is as fast or faster (one conversion for all
 * rows). int4 widens from 9: its nibble unpacking costs more per chunk. */
#define TG_WIDEN_INT8_FROM 13
static __thread float *tg_wbuf;
static __thread int64_t tg_wbuf_len;

static float *widen_buffer(int64_t floats) {
    if (tg_wbuf_len < floats) {
        free(tg_wbuf);
        tg_wbuf = malloc(sizeof(float) * (size_t)floats);
        tg_wbuf_len = tg_wbuf ? floats : 0;
    }
    return tg_wbuf;
}

/* Returns 0 (done) or -1 (too few rows: TG_MAX_M for int4, fewer than
 * TG_WIDEN_INT8_FROM for int8; or no buffer: the caller takes the few-rows path, which
 * widens in registers). */
static int gemv_widened(const float *x, int64_t M_all, int64_t K, const int8_t *w8, const uint8_t *w4,
                        const uint16_t *scale, const uint16_t *lo, int64_t G, int64_t n0, int64_t n1, float *y,
                        int64_t ldy) {
    if (M_all <= (w8 ? TG_WIDEN_INT8_FROM - 1 : TG_MAX_M)) return -1;
    float *buf = widen_buffer((n1 - n0) * K);
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
/* ---- small fused ops of a decode layer (one call instead of 5-7 torch ops) ---------- */

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of `dim` floats (contiguous). With
 * `residual` non-NULL first residual[r] += x[r] and the sum is normalised (the decoder's
 * `h = x + attn; norm(h)`). Same arithmetic order as transformers' float32 RMSNorm. */
static inline void rms_row(const float *in, float *res, const float *w, float *o, int64_t dim, float eps) {
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
static inline void silu_row(const float *g, float *o, int64_t inter) {
    const float *u = g + inter;
    for (int64_t j = 0; j < inter; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
}

void tg_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) silu_row(gu + r * 2 * inter, out + r * inter, inter);
}

/* The whole decode step of a Llama layer stack in one call: decode_step.inc. */
#include "decode_step.inc"

int tg_abi_version(void) { return 9; }
