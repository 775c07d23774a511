/* Decode attention over the paged KV pool, read in place (CPU, float32).
 *
 * Without the kernel the engine uses the torch path in attention.py, which computes the
 * same thing from a gathered copy of the blocks.
 *
 * Why: a torch decode step gathers each sequence's blocks into a contiguous copy per
 * layer (read + write + read of the whole context) and spends a dozen small ops per
 * layer on it. Here one call per layer writes the new token's K/V into its slot and
 * attends over the context through the block table: every K and V row is read once,
 * where it is.
 *
 * Pool layout (tierguard/kv/spec.py, blocks first), one layer's view:
 *   element (block, kv_or_v, slot, head, d) at
 *   pool[block * blk_stride + kv_or_v * v_offset + slot * heads_kv * D + head * D + d]
 */
#include "tg_kernels.h"

/* Sequence b's new K and V rows of KV heads [h0, h1) into its slot of the pool. */
void store_heads(const tg_decode_args *a, int b, int h0, int h1) {
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

/* Prefetches slot s's share (of n slots) of `bytes` from `next` (the next block's rows):
 * a sequence's blocks lie anywhere in the pool, so the hardware prefetcher finds each
 * block's stream only after stalling on its first lines, and a decode step of many long
 * sequences, bound by reading their K/V, ran far below the memory's bandwidth. */
static inline void prefetch_share(const float *next, int64_t bytes, int s, int n) {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t l = s * lines / n, l1 = (s + 1) * lines / n; l < l1; l++)
        __builtin_prefetch((const char *)next + l * 64, 0, 3);
}

/* attend() for a unit of several KV heads (a whole sequence, when there are at least as
 * many sequences as threads). Slot-major: each slot's K (then V) row of these heads is
 * read once, contiguously, for all of their query heads, and the next block's rows are
 * prefetched while a block is in use: with long contexts the unit is bound by memory.
 * Scores four slots at a time (dot4: one horizontal-sum tree per four), the V rows
 * weighted into the heads' accumulators. Head dims that are multiples of 8 (all the
 * models we run) take the vector path; others the scalar loops. */
static void attend_slots(const tg_decode_args *a, int b, int h0, int h1) {
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size;
    const int G = a->heads / KV, NQ = (h1 - h0) * G; /* query heads handled here */
    const int L = a->ctx[b];
    const int64_t row = (int64_t)KV * D, ws = a->work_stride;
    const int64_t bytes = ((int64_t)(bs - 1) * row + (int64_t)(h1 - h0) * D) * 4; /* a block's span of these heads */
    const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
    const float *qsrc = a->q + (int64_t)b * a->q_stride + (int64_t)h0 * G * D;
    float *scores = a->work + ((int64_t)b * a->heads + (int64_t)h0 * G) * ws;
    float q[NQ * D], acc[NQ * D], sum[NQ];
    for (int i = 0; i < NQ * D; i++) {
        q[i] = qsrc[i] * a->scale;
        acc[i] = 0.f;
    }
    const int vec = D % 8 == 0;
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + (int64_t)h0 * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        const float *next = j0 + bs < L ? a->pool + (int64_t)table[j0 / bs + 1] * a->blk_stride + (int64_t)h0 * D : NULL;
        int s = 0;
        if (vec)
            for (; s + 4 <= n; s += 4) {
                const float *k = base + s * row;
                if (next)
                    for (int r = s; r < s + 4; r++) prefetch_share(next, bytes, r, bs);
                for (int i = 0; i < NQ; i++) {
                    const int64_t off = (int64_t)(i / G) * D;
                    dot4(q + i * D, k + off, k + row + off, k + 2 * row + off, k + 3 * row + off, D,
                         scores + i * ws + j0 + s);
                }
            }
        for (; s < n; s++) {
            const float *krow = base + s * row;
            if (next) prefetch_share(next, bytes, s, bs);
            for (int i = 0; i < NQ; i++) {
                const float *k = krow + (i / G) * D, *qi = q + i * D;
                float dot;
                if (vec) {
                    dot = dot1(qi, k, D);
                } else {
                    dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qi[d] * k[d];
                }
                scores[(int64_t)i * ws + j0 + s] = dot;
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        float *si = scores + (int64_t)i * ws;
        float m = -FLT_MAX, s = 0.f; /* finite: built with -ffast-math */
        for (int j = 0; j < L; j++) m = si[j] > m ? si[j] : m;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < L; j++) {
            si[j] = expf(si[j] - m);
            s += si[j];
        }
        sum[i] = s;
    }
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + a->v_offset + (int64_t)h0 * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        const float *next =
            j0 + bs < L ? a->pool + (int64_t)table[j0 / bs + 1] * a->blk_stride + a->v_offset + (int64_t)h0 * D : NULL;
        for (int s = 0; s < n; s++) {
            const float *vrow = base + s * row;
            if (next) prefetch_share(next, bytes, s, bs);
            for (int i = 0; i < NQ; i++) {
                const float p = scores[(int64_t)i * ws + j0 + s];
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
 * 8 dims x up to TG_PV_HEADS heads per pass. Why: a slot-at-a-time loop spends more on
 * horizontal sums and on reloading the output rows than on the multiply-adds. Head dims
 * that are multiples of 8 (all the models we run) take the vector path; others scalar
 * loops. */
void attend(const tg_decode_args *a, int b, int h0, int h1) {
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
        const float *next = j0 + bs < L ? a->pool + (int64_t)table[j0 / bs + 1] * a->blk_stride + head_off : NULL;
        int s = 0;
        if (vec)
            for (; s + 4 <= n; s += 4, k += 4 * row) {
                if (next) /* this head's part of the next block's rows s .. s + 3 */
                    for (int r = s; r < s + 4; r++) prefetch_share(next + r * row, (int64_t)D * 4, 0, 1);
                for (int g = 0; g < G; g++)
                    dot4(q + g * D, k, k + row, k + 2 * row, k + 3 * row, D, scores + g * ws + j0 + s);
            }
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
                    if (g0 == 0 && d0 == 0 && j0 + bs < L) /* the first pass reads the V rows from memory */
                        for (int r = 0; r < bs; r++)
                            prefetch_share(a->pool + (int64_t)table[j0 / bs + 1] * a->blk_stride + a->v_offset +
                                               head_off + r * row, (int64_t)D * 4, 0, 1);
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

/* ---- the rows of a prefill chunk ----
 * Rows [b0, b0 + n) of one sequence at consecutive positions (ctx[b0 + r] = ctx[b0] + r,
 * one block table), all of whose K/V are in the pool, for KV head h: each of the n x G
 * query vectors attends causally over keys [0, its row's ctx). Why not attend() per row:
 * per row and head it re-reads the whole context and spends a horizontal sum per four
 * keys, so a chunk's attention cost a third of its matmuls; here the context's K is
 * transposed once per unit ([D][keys]: 16 keys per vector) and the scores, softmax and
 * P.V run as register tiles of full-width multiply-adds, no horizontal sums.
 * Needs D % 16 == 0 (chunk_ok); 16-float vectors of GCC's vector extensions, which the
 * compiler splits into halves or quarters on CPUs without AVX-512. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#if defined(__AVX512F__)
#define TG_QT 8  /* query vectors per score tile (x 2 key vectors) */
#define TG_OT 6  /* query vectors per output tile (x D / 16 vectors) */
#else
#define TG_QT 2
#define TG_OT 2
#endif

static __thread float *tg_abuf;
static __thread int64_t tg_abuf_len;

/* sc[t][j0 .. j0 + 32) = q_t . K[j] for nt query vectors (rows of D) and the keys
 * j < lim (rounded up to 32), K transposed in kt [D][Lp]. */
static inline __attribute__((always_inline)) void score_tile(const float *q, int D, const float *kt, int Lp, int lim,
                                                            const int nt, float *sc) {
    for (int j0 = 0; j0 < lim; j0 += 32) {
        v16 acc0[TG_QT], acc1[TG_QT];
        for (int t = 0; t < nt; t++) acc0[t] = acc1[t] = (v16){0};
        for (int d = 0; d < D; d++) {
            const v16 k0 = *(const v16 *)(kt + (int64_t)d * Lp + j0), k1 = *(const v16 *)(kt + (int64_t)d * Lp + j0 + 16);
            for (int t = 0; t < nt; t++) {
                const float qv = q[(int64_t)t * D + d];
                acc0[t] += qv * k0;
                acc1[t] += qv * k1;
            }
        }
        for (int t = 0; t < nt; t++) {
            *(v16 *)(sc + (int64_t)t * Lp + j0) = acc0[t];
            *(v16 *)(sc + (int64_t)t * Lp + j0 + 16) = acc1[t];
        }
    }
}

/* o[t][0 .. 16 DV) = sum over keys j < lim of p[t][j] V[j] for nt query vectors, the V
 * rows read through the block table (v: the pool's V of this head, block 0 slot 0). */
static inline __attribute__((always_inline)) void pv_tile(const float *p, int Lp, const float *v, const int32_t *table,
                                                         int64_t blk, int64_t row, int bs, int lim, const int nt,
                                                         const int DV, float **o) {
    v16 acc[TG_OT][8];
    for (int t = 0; t < nt; t++)
        for (int c = 0; c < DV; c++) acc[t][c] = (v16){0};
    for (int j = 0; j < lim; j++) {
        const float *vr = v + (int64_t)table[j / bs] * blk + (int64_t)(j % bs) * row;
        for (int t = 0; t < nt; t++) {
            const float pt = p[(int64_t)t * Lp + j];
            for (int c = 0; c < DV; c++) acc[t][c] += pt * *(const v16 *)(vr + 16 * c);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int c = 0; c < DV; c++) *(v16 *)(o[t] + 16 * c) = acc[t][c];
}

int chunk_ok(const tg_decode_args *a) { return a->head_dim % 16 == 0; }

/* Returns 0, or -1 without memory for its buffers (the caller then runs attend per row). */
int attend_chunk(const tg_decode_args *a, int b0, int n, int h) {
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size, G = a->heads / KV, NQ = n * G;
    const int L = a->ctx[b0 + n - 1], Lp = (L + 31) / 32 * 32;
    const int64_t row = (int64_t)KV * D;
    const int32_t *table = a->tables + (int64_t)a->rows[b0] * a->table_stride;
    float *buf = tg_thread_buffer(&tg_abuf, &tg_abuf_len, (int64_t)D * Lp + (int64_t)NQ * (Lp + D));
    if (!buf) return -1;
    float *kt = buf, *sc = kt + (int64_t)D * Lp, *q = sc + (int64_t)NQ * Lp;
    for (int j = 0; j < Lp; j++) { /* K^T: kt[d * Lp + j] */
        if (j < L) {
            const float *k = a->pool + (int64_t)table[j / bs] * a->blk_stride + (int64_t)(j % bs) * row + (int64_t)h * D;
            for (int d = 0; d < D; d++) kt[(int64_t)d * Lp + j] = k[d];
        } else {
            for (int d = 0; d < D; d++) kt[(int64_t)d * Lp + j] = 0.f;
        }
    }
    for (int i = 0; i < NQ; i++) { /* query vector i: row i / G, head h * G + i % G */
        const float *src = a->q + (int64_t)(b0 + i / G) * a->q_stride + (int64_t)(h * G + i % G) * D;
        for (int d = 0; d < D; d++) q[(int64_t)i * D + d] = src[d] * a->scale;
    }
    /* scores: tiles of TG_QT query vectors x 32 keys, over the keys the tile's last row sees */
    for (int i0 = 0; i0 < NQ; i0 += TG_QT) {
        const int nt = NQ - i0 < TG_QT ? NQ - i0 : TG_QT, lim = a->ctx[b0 + (i0 + nt - 1) / G];
        if (nt == TG_QT)
            score_tile(q + (int64_t)i0 * D, D, kt, Lp, lim, TG_QT, sc + (int64_t)i0 * Lp);
        else
            score_tile(q + (int64_t)i0 * D, D, kt, Lp, lim, nt, sc + (int64_t)i0 * Lp);
    }
    /* softmax over each query's own keys; the probabilities of keys it may not see, up to
     * the limit of its output tile (the tile's last row), are zero */
    for (int i = 0; i < NQ; i++) {
        float *si = sc + (int64_t)i * Lp;
        const int last = (i / TG_OT + 1) * TG_OT - 1 < NQ ? (i / TG_OT + 1) * TG_OT - 1 : NQ - 1;
        const int li = a->ctx[b0 + i / G], lt = a->ctx[b0 + last / G];
        float m = -FLT_MAX, sum = 0.f; /* finite: built with -ffast-math */
        for (int j = 0; j < li; j++) m = si[j] > m ? si[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < li; j++) {
            si[j] = expf(si[j] - m);
            sum += si[j];
        }
        const float inv = 1.f / sum;
        for (int j = 0; j < li; j++) si[j] *= inv;
        for (int j = li; j < lt; j++) si[j] = 0.f;
    }
    /* out = P . V: tiles of TG_OT query vectors x D, one pass over the V rows */
    for (int i0 = 0; i0 < NQ; i0 += TG_OT) {
        const int nt = NQ - i0 < TG_OT ? NQ - i0 : TG_OT, lim = a->ctx[b0 + (i0 + nt - 1) / G];
        float *o[TG_OT];
        for (int t = 0; t < nt; t++)
            o[t] = a->out + (int64_t)(b0 + (i0 + t) / G) * a->heads * D + (int64_t)(h * G + (i0 + t) % G) * D;
        const float *p = sc + (int64_t)i0 * Lp, *v = a->pool + a->v_offset + (int64_t)h * D;
        if (nt == TG_OT && D == 64)
            pv_tile(p, Lp, v, table, a->blk_stride, row, bs, lim, TG_OT, 4, o);
        else if (nt == TG_OT && D == 128)
            pv_tile(p, Lp, v, table, a->blk_stride, row, bs, lim, TG_OT, 8, o);
        else
            for (int t = 0; t < nt; t++)
                for (int v0 = 0; v0 < D; v0 += 16) {
                    float *ot = o[t] + v0;
                    pv_tile(p + (int64_t)t * Lp, Lp, v + v0, table, a->blk_stride, row, bs, lim, 1, 1, &ot);
                }
    }
    return 0;
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
