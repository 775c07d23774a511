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
#include <math.h>
#include <stdint.h>
#include <string.h>

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

static void store_new(const tg_decode_args *a) {
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size;
    for (int b = 0; b < a->batch; b++) {
        const int32_t slot = a->ctx[b] - 1;
        const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
        float *dst = a->pool + (int64_t)table[slot / bs] * a->blk_stride + (int64_t)(slot % bs) * KV * D;
        memcpy(dst, a->k_new + b * a->k_stride, sizeof(float) * KV * D);
        memcpy(dst + a->v_offset, a->v_new + b * a->v_stride, sizeof(float) * KV * D);
    }
}

/* 8 floats; loads and stores through it need no alignment. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8 x) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += x[i];
    return s;
}

/* One sequence, one KV head: its G = heads / kv_heads query heads together, so each K
 * and V row is loaded once for all of them. Head dims that are multiples of 8 (all the
 * models we run) take the vector path; others the scalar loops. */
static void attend_one(const tg_decode_args *a, int b, int h) {
    const int KV = a->kv_heads, D = a->head_dim, bs = a->block_size;
    const int G = a->heads / KV;
    const int L = a->ctx[b];
    const int64_t row = (int64_t)KV * D;
    const int32_t *table = a->tables + (int64_t)a->rows[b] * a->table_stride;
    const float *qsrc = a->q + (int64_t)b * a->q_stride + (int64_t)h * G * D;
    float *scores = a->work + ((int64_t)b * a->heads + (int64_t)h * G) * a->work_stride;
    float q[G * D], acc[G * D], mx[G], sum[G];
    for (int i = 0; i < G * D; i++) {
        q[i] = qsrc[i] * a->scale;
        acc[i] = 0.f;
    }
    for (int g = 0; g < G; g++) mx[g] = -FLT_MAX; /* finite: built with -ffast-math */
    const int vec = D % 8 == 0;
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base = a->pool + (int64_t)table[j0 / bs] * a->blk_stride + (int64_t)h * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int s = 0; s < n; s++) {
            const float *k = base + s * row;
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float dot;
                if (vec) {
                    v8 x0 = {0}, x1 = {0};
                    int d = 0;
                    for (; d + 16 <= D; d += 16) {
                        x0 += *(const v8 *)(qg + d) * *(const v8 *)(k + d);
                        x1 += *(const v8 *)(qg + d + 8) * *(const v8 *)(k + d + 8);
                    }
                    if (d < D) x0 += *(const v8 *)(qg + d) * *(const v8 *)(k + d);
                    dot = hsum8(x0 + x1);
                } else {
                    dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                }
                scores[(int64_t)g * a->work_stride + j0 + s] = dot;
                if (dot > mx[g]) mx[g] = dot;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * a->work_stride;
        float s = 0.f;
        const float m = mx[g];
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < L; j++) {
            sg[j] = expf(sg[j] - m);
            s += sg[j];
        }
        sum[g] = s;
    }
    for (int j0 = 0; j0 < L; j0 += bs) {
        const float *base =
            a->pool + (int64_t)table[j0 / bs] * a->blk_stride + a->v_offset + (int64_t)h * D;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int s = 0; s < n; s++) {
            const float *v = base + s * row;
            for (int g = 0; g < G; g++) {
                const float p = scores[(int64_t)g * a->work_stride + j0 + s];
                float *o = acc + g * D;
                if (vec) {
                    for (int d = 0; d < D; d += 8) *(v8 *)(o + d) += p * *(const v8 *)(v + d);
                } else {
                    for (int d = 0; d < D; d++) o[d] += p * v[d];
                }
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *o = a->out + ((int64_t)b * a->heads + (int64_t)h * G + g) * D;
        const float inv = 1.f / sum[g];
        for (int d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
    }
}

/* Returns 0, or -1 when a group's queries (G x head_dim floats) would not fit the stack
 * buffers' budget. */
int tg_decode_attention_f32(const tg_decode_args *a) {
    if ((int64_t)(a->heads / a->kv_heads) * a->head_dim > 8192) return -1;
    store_new(a);
    const int n = a->batch * a->kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int i = 0; i < n; i++) attend_one(a, i / a->kv_heads, i % a->kv_heads);
    return 0;
}

int tg_abi_version(void) { return 1; }
