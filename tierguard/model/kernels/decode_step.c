/* A whole step of a Llama layer stack, float32 activations, in one call: decodes, and
 * the tokens of prefill chunks as rows of their own.
 * Built from the other families (the GEMV rows and tiles, the bfloat16 panels, `attend`
 * and `store_heads`, the row-wise ops); driven by tierguard/model/fused_decode.py.
 *
 * Why: with eager torch a small model's decode step is hundreds of small ops; their
 * dispatch, the allocations and the OpenMP fork/joins cost about as much as reading the
 * weights. Here the layers run inside one OpenMP parallel region: the threads split
 * each matmul's output rows and the attention's (sequence, KV head) units, and meet at
 * five barriers per layer. The arithmetic is the per-op kernels' own (same functions,
 * same order), so the step equals the per-op path up to the rounding of the rope.
 *
 * Per layer, for B rows (x: the residual stream, [B, hidden]):
 *   h = rmsnorm(x) (layer 0; later layers get it from the previous layer's end)
 *   qkv = h Wqkv^T (+ bias); rotate q, k; write k, v into the pool; att = attention
 *   x += att Wo^T; h = rmsnorm(x)
 *   x += silu_mul(h Wgu^T) Wdown^T; h = rmsnorm(x) with the next layer's (or the final) norm
 *
 * Up to TG_DUP_ROWS rows (decodes, small chunks) every thread keeps its own copy of the
 * residual stream and repeats the row-wise ops on it (below); more rows (a step with a
 * prefill chunk, where the row-wise work is no longer small) share one copy and split
 * the row-wise ops by rows, with a barrier after each.
 */
#include "tg_kernels.h"

enum { TG_LIN_F32 = 0, TG_LIN_INT8 = 1, TG_LIN_INT4 = 2, TG_LIN_BF16 = 3 };

/* Rows up to which each thread repeats the row-wise ops on its own copy of the rows. */
#define TG_DUP_ROWS 16

typedef struct {
    int32_t kind;       /* TG_LIN_* */
    int32_t group;      /* int4 group size (inputs per scale) */
    int64_t n, k;       /* output rows, inputs */
    const void *w;      /* f32 [n, k] | int8 [n, k] | int4 bytes [n, k / 2] | bf16 panels (qlinear.py layouts) */
    const void *scale;  /* int8: f16 [n, ceil(k / 32)]; int4: f16 [n, k / group] */
    const void *lo;     /* int4: f16 [n, k / group] */
    const float *bias;  /* [n] or NULL */
} tg_lin;

typedef struct {
    const float *in_norm, *post_norm;
    tg_lin qkv, o, gate_up, down;
} tg_layer_w;

typedef struct {
    int32_t num_layers, hidden, inter, heads, kv_heads, head_dim;
    float eps;
    const tg_layer_w *layers;
    const float *final_norm;
} tg_model_w;

typedef struct {
    const tg_model_w *model;
    int32_t batch, block_size;
    int64_t layer_stride;  /* elements between layers in the pool (kv_cache.stride(1)) */
    int64_t blk_stride;    /* elements between blocks (kv_cache.stride(0)) */
    int64_t v_offset;      /* elements from a block's K to its V (kv_cache.stride(2)) */
    int64_t table_stride, work_stride;
    float *pool;           /* kv_cache[0, 0, 0, 0, 0, 0] */
    const int32_t *tables, *rows, *ctx; /* as tg_decode_args */
    const float *cos, *sin;             /* [batch, head_dim]: cos and signed sin (layers.py) */
    float *x;              /* [batch, hidden] the embeddings in; clobbered (residual stream) */
    float *out;            /* [batch, hidden] final-normed hidden states */
    float *scratch;        /* tg_decode_step_scratch(model, batch, threads) floats */
    int64_t threads;       /* team size (torch's thread count; `scratch` is sized for it) */
    float *work;           /* [batch * heads, work_stride] attention scores */
    int64_t ordered;       /* rows of one sequence's prefill chunk are in the batch (see below) */
} tg_step_args;

static int64_t qkv_width(const tg_model_w *m) { return (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim; }

static int64_t max_in(const tg_model_w *m) { /* the widest matmul input */
    const int64_t q = (int64_t)m->heads * m->head_dim;
    return m->inter > m->hidden ? (m->inter > q ? m->inter : q) : (m->hidden > q ? m->hidden : q);
}

/* Floats per copy of the rows' state: the residual stream, its norm, the activation, and
 * the rows' bfloat16 copy of a matmul input. */
static int64_t rows_state(const tg_model_w *m, int64_t batch) {
    return batch * (2 * (int64_t)m->hidden + m->inter + (max_in(m) + 2) / 2) + 16;
}

/* Floats of scratch a step of `batch` rows needs on `threads` threads (the caller
 * allocates them): shared qkv / att / tmp / gate_up; the rows' state, one copy per
 * thread up to TG_DUP_ROWS rows, else one; per thread the int4 group sums. */
int64_t tg_decode_step_scratch(const tg_model_w *m, int64_t batch, int64_t threads) {
    const int64_t shared = qkv_width(m) + (int64_t)m->heads * m->head_dim + m->hidden + 2 * (int64_t)m->inter;
    const int64_t copies = batch <= TG_DUP_ROWS ? threads : 1;
    return batch * shared + copies * rows_state(m, batch) + threads * (batch * (max_in(m) / 16 + 1) + 16);
}

/* Output rows [n0, n1) of one linear for M_all activation rows. */
static void lin_rows(const tg_lin *L, const float *x, int64_t M_all, const float *xsum, int64_t n0, int64_t n1,
                     float *y) {
    const int64_t K = L->k, ldy = L->n;
    switch (L->kind) {
    case TG_LIN_F32:
        if (M_all > TG_MAX_M)
            gemm_f32_tiled(x, M_all, K, (const float *)L->w + n0 * K, n1 - n0, y + n0, ldy);
        else
            TG_CHUNKS(gemv_f32_rows(x + m0 * K, M, K, (const float *)L->w, n0, n1, y + m0 * ldy, ldy))
        break;
    case TG_LIN_INT8:
        if (gemv_widened(x, M_all, K, (const int8_t *)L->w, NULL, (const uint16_t *)L->scale, NULL, 32, n0, n1, y,
                         ldy))
            TG_CHUNKS(gemv_int8_rows(x + m0 * K, M, K, (const int8_t *)L->w, (const uint16_t *)L->scale, n0, n1,
                                     y + m0 * ldy, ldy))
        break;
    default: {
        const int64_t ng = K / L->group;
        if (gemv_widened(x, M_all, K, NULL, (const uint8_t *)L->w, (const uint16_t *)L->scale, (const uint16_t *)L->lo,
                         L->group, n0, n1, y, ldy))
            TG_CHUNKS(gemv_int4_rows(x + m0 * K, M, K, (const uint8_t *)L->w, (const uint16_t *)L->scale,
                                     (const uint16_t *)L->lo, L->group, xsum + m0 * ng, n0, n1, y + m0 * ldy, ldy))
    } break;
    }
}

/* y [M, n] = x [M, k] W^T (+ bias), output rows split over the threads, then a barrier.
 * Called by every thread of the region; `x` may be the thread's private copy (`dup`:
 * every copy holds the same values), `xsum` is private scratch, `xb` the rows' bfloat16
 * copy (the thread's own with `dup`, else shared: the threads convert a share of the
 * rows each and meet at a barrier first). */
static void lin_par(const tg_lin *L, const float *x, int64_t M, float *xsum, uint16_t *xb, int dup, float *y) {
    const int64_t K = L->k, N = L->n;
    if (L->kind == TG_LIN_INT4) { /* per-group sums of x: the lo term (each thread its own) */
        const int64_t G = L->group, ng = K / G;
        for (int64_t i = 0; i < M * ng; i++) {
            const float *xg = x + (i / ng) * K + (i % ng) * G;
            float s = 0.f;
            for (int64_t j = 0; j < G; j++) s += xg[j];
            xsum[i] = s;
        }
    }
    if (L->kind == TG_LIN_BF16) {
        int64_t a, b;
        if (dup) {
            bf16_rows(x, 0, M, K, xb);
        } else {
            tg_thread_share(M, &a, &b);
            bf16_rows(x, a, b, K, xb);
#pragma omp barrier
        }
        tg_thread_share((N + TG_BF16_NR - 1) / TG_BF16_NR, &a, &b);
        bf16_panels(xb, M, K, (const uint16_t *)L->w, N, a, b, y, N);
        if (L->bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = a * TG_BF16_NR; n < N && n < b * TG_BF16_NR; n++) y[m * N + n] += L->bias[n];
#pragma omp barrier
        return;
    }
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
        lin_rows(L, x, M, xsum, n0, n1, y);
        if (L->bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n1; n++) y[m * N + n] += L->bias[n];
    }
}

/* The row-wise ops over rows [0, B): with `dup` every thread does all rows on its own
 * copy; else the threads split the rows of the one copy, then meet at a barrier. */
#define TG_ROWS(B, dup, BODY)                                                            \
    if (dup) {                                                                           \
        for (int64_t b = 0; b < (B); b++) BODY;                                          \
    } else {                                                                             \
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < (B); b++) BODY;      \
    }

/* Rotary embedding of `n` heads of D floats, in place. */
static void rope_heads(float *v, int n, int D, const float *cos, const float *sin) {
    const int half = D / 2;
    float t[D];
    for (int h = 0; h < n; h++, v += D) {
        for (int d = 0; d < half; d++) {
            t[d] = v[d] * cos[d] + v[d + half] * sin[d];
            t[d + half] = v[d + half] * cos[d + half] + v[d] * sin[d + half];
        }
        memcpy(v, t, sizeof(float) * D);
    }
}

/* Rotates sequence b's query heads of KV heads [h0, h1) and those K heads, and writes
 * the new K/V of those heads into the pool. */
static void rope_store(const tg_decode_args *a, const float *cos, const float *sin, int b, int h0, int h1) {
    const int D = a->head_dim, G = a->heads / a->kv_heads;
    float *q = (float *)a->q + (int64_t)b * a->q_stride, *k = (float *)a->k_new + (int64_t)b * a->k_stride;
    rope_heads(q + (int64_t)h0 * G * D, (h1 - h0) * G, D, cos + (int64_t)b * D, sin + (int64_t)b * D);
    rope_heads(k + (int64_t)h0 * D, h1 - h0, D, cos + (int64_t)b * D, sin + (int64_t)b * D);
    store_heads(a, b, h0, h1);
}

/* One attention unit: sequence b, KV heads [h0, h1) and their query heads: rope_store,
 * then attend. Units own disjoint heads, so they need no barrier between these parts
 * (unless a prefill chunk's rows are in the batch: `ordered` below). */
static void unit(const tg_decode_args *a, const float *cos, const float *sin, int b, int h0, int h1) {
    rope_store(a, cos, sin, b, h0, h1);
    attend(a, b, h0, h1);
}

/* The attention of a step with prefill rows, as units: a run of rows of one sequence at
 * consecutive positions (a prefill chunk) in blocks of TG_CHUNK_ROWS rows per KV head
 * (attend_chunk), and every other row (a decode) as one unit of all its KV heads
 * (h = -1: attend_slots reads each slot's row once for all heads). Returns the count. */
#define TG_CHUNK_ROWS 16
typedef struct {
    int32_t b0, n, h;
} att_unit;

static int64_t att_units(const tg_decode_args *a, att_unit *out) {
    int64_t count = 0;
    const int B = a->batch, chunks = chunk_ok(a);
    for (int b0 = 0; b0 < B;) {
        int b1 = b0 + 1;
        while (chunks && b1 < B && a->rows[b1] == a->rows[b0] && a->ctx[b1] == a->ctx[b1 - 1] + 1) b1++;
        if (b1 == b0 + 1) { /* a decode: one unit of all its heads (each slot's row read once) */
            out[count++] = (att_unit){b0, 1, -1};
            b0 = b1;
            continue;
        }
        for (int h = 0; h < a->kv_heads; h++)
            for (int r = b0; r < b1; r += TG_CHUNK_ROWS)
                out[count++] = (att_unit){r, b1 - r < TG_CHUNK_ROWS ? b1 - r : TG_CHUNK_ROWS, h};
        b0 = b1;
    }
    return count;
}

/* Returns 0, or -1 for a shape it does not take (the caller runs the per-op path).
 * A row is one token: a decode, or one token of a prefill chunk, which is a row whose
 * context ends at its own position (ctx = position + 1, the same table row as its
 * chunk's other tokens). Such a row must see the K/V its chunk's earlier rows write in
 * this step, so with `ordered` every row's K/V is stored before any row attends: one
 * more barrier per layer, paid only by steps that carry prefill.
 * Barriers: one after each matmul and one after the attention, five per layer. Up to
 * TG_DUP_ROWS rows the small row-wise ops (residual add, RMSNorm, SiLU x up) are done by
 * every thread on its own copy of the rows instead of by one thread between two more
 * barriers: a few microseconds of duplicated arithmetic against a barrier, which costs
 * a whole time slice when a thread of ours is descheduled on a busy machine. Past it
 * the rows are split, three more barriers per layer in a step that long. */
int tg_decode_step(const tg_step_args *s) {
    const tg_model_w *m = s->model;
    const int64_t B = s->batch, H = m->hidden, I = m->inter, D = m->head_dim;
    const int64_t QKV = qkv_width(m), QS = (int64_t)m->heads * D, KVS = (int64_t)m->kv_heads * D;
    if (B < 1 || B > TG_MAX_STEP_ROWS || (int64_t)m->heads * D > 16384 || D % 2 != 0 || m->heads % m->kv_heads ||
        s->threads < 1)
        return -1;
    const int dup = B <= TG_DUP_ROWS;
    float *qkv = s->scratch, *att = qkv + B * QKV, *tmp = att + B * QS, *gu = tmp + B * H;
    float *state0 = gu + B * 2 * I, *xsum0 = state0 + (dup ? s->threads : 1) * rows_state(m, B);
    tg_decode_args a = {0};
    a.batch = (int32_t)B;
    a.heads = m->heads;
    a.kv_heads = m->kv_heads;
    a.head_dim = m->head_dim;
    a.block_size = s->block_size;
    a.q_stride = a.k_stride = a.v_stride = QKV;
    a.blk_stride = s->blk_stride;
    a.v_offset = s->v_offset;
    a.table_stride = s->table_stride;
    a.work_stride = s->work_stride;
    a.scale = 1.f / sqrtf((float)D);
    a.q = qkv;
    a.k_new = qkv + QS;
    a.v_new = qkv + QS + KVS;
    a.tables = s->tables;
    a.rows = s->rows;
    a.ctx = s->ctx;
    a.out = att;
    a.work = s->work;
    const int KV = m->kv_heads;
    att_unit *units = s->ordered ? malloc(sizeof(att_unit) * (size_t)(B * KV)) : NULL;
    if (s->ordered && !units) return -1;
    const int64_t nunits = units ? att_units(&a, units) : 0;
#pragma omp parallel num_threads(s->threads)
    {
        const int tid = omp_get_thread_num();
        float *x = state0 + (dup ? tid : 0) * rows_state(m, B), *h = x + B * H, *act = h + B * H;
        uint16_t *xb = (uint16_t *)(act + B * I);
        float *xsum = xsum0 + tid * (B * (max_in(m) / 16 + 1) + 16);
        tg_decode_args u = a; /* this thread's view: only the pool pointer changes per layer */
        const int per_seq = B >= omp_get_num_threads();
        TG_ROWS(B, dup, {
            memcpy(x + b * H, s->x + b * H, sizeof(float) * H);
            rms_row(x + b * H, NULL, m->layers[0].in_norm, h + b * H, H, m->eps);
        })
        for (int l = 0; l < m->num_layers; l++) {
            const tg_layer_w *L = m->layers + l;
            lin_par(&L->qkv, h, B, xsum, xb, dup, qkv);
            u.pool = s->pool + l * s->layer_stride;
            if (s->ordered) {
#pragma omp for schedule(static)
                for (int64_t b = 0; b < B; b++) rope_store(&u, s->cos, s->sin, (int)b, 0, KV);
#pragma omp for schedule(dynamic, 1)
                for (int64_t i = 0; i < nunits; i++) {
                    const att_unit *w = units + i;
                    if (w->h < 0) {
                        attend(&u, w->b0, 0, KV);
                        continue;
                    }
                    if (w->n > 1 && attend_chunk(&u, w->b0, w->n, w->h) == 0) continue;
                    for (int r = 0; r < w->n; r++) attend(&u, w->b0 + r, w->h, w->h + 1);
                }
            } else if (per_seq) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t b = 0; b < B; b++) unit(&u, s->cos, s->sin, (int)b, 0, KV);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t i = 0; i < B * KV; i++)
                    unit(&u, s->cos, s->sin, (int)(i / KV), (int)(i % KV), (int)(i % KV) + 1);
            }
            lin_par(&L->o, att, B, xsum, xb, dup, tmp);
            TG_ROWS(B, dup, rms_row(tmp + b * H, x + b * H, L->post_norm, h + b * H, H, m->eps))
            lin_par(&L->gate_up, h, B, xsum, xb, dup, gu);
            TG_ROWS(B, dup, silu_row(gu + b * 2 * I, act + b * I, I))
            lin_par(&L->down, act, B, xsum, xb, dup, tmp);
            const float *next = l + 1 < m->num_layers ? m->layers[l + 1].in_norm : m->final_norm;
            TG_ROWS(B, dup, rms_row(tmp + b * H, x + b * H, next, h + b * H, H, m->eps))
        }
        if (dup) {
            if (tid == 0) memcpy(s->out, h, sizeof(float) * B * H);
        } else {
            TG_ROWS(B, dup, memcpy(s->out + b * H, h + b * H, sizeof(float) * H))
        }
    }
    free(units);
    return 0;
}

int tg_abi_version(void) { return 10; }
