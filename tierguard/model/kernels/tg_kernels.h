/* tierguard's CPU kernels: one shared object, built at first use by
 * tierguard/model/native.py with the system C compiler and loaded with ctypes. Plain C99
 * with GCC vector extensions, OpenMP for the threads (torch's own runtime), x86
 * intrinsics where the compiler targets them and plain loops elsewhere. Without a
 * compiler the engine runs the same arithmetic with torch ops.
 *
 * The families, one file each (every exported entry point returns -1, or refuses, for a
 * shape it does not take, and the caller then uses torch):
 *   attention.c    decode attention over the paged KV pool, read in place through the
 *                  block table (tg_decode_attention_f32); writes the new token's K/V first.
 *   gemv.c         weight-only matmuls for a few activation rows (decode): float32, int8
 *                  (GGUF Q8_0 blocks) and int4 (GGUF Q4_1 layout) rows, each weight byte
 *                  read once and widened in registers; blocks widened to float32 once
 *                  for many rows; int8 quantization with a scale search; dequantization
 *                  of row ranges for torch's GEMM (tg_gemv_*, tg_quantize_int8,
 *                  tg_dequant_*).
 *   tiles.c        float32 register tiles (4 activation rows x 3 weight rows) for steps of
 *                  more rows than TG_MAX_M (gemm_f32_tiled).
 *   bf16.c         bfloat16 weights in panels for many activation rows, with
 *                  AVX512-BF16 dot products where the CPU has them (tg_gemm_bf16).
 *   ops.c          the row-wise ops of a decode layer: RMSNorm with the residual add, and
 *                  SiLU(gate) x up (tg_rms_norm, tg_silu_mul).
 *   isa.c          what the library was compiled for (tg_isa) and the peak rate of its
 *                  multiply-add instructions (tg_peak).
 *   decode_step.c  a whole decode step of a Llama layer stack in one OpenMP region, built
 *                  from the families above (tg_decode_step, tg_decode_step_scratch), and
 *                  tg_abi_version.
 *
 * This header holds what more than one family uses: the vector type and its helpers,
 * the row-count limits and the macros that specialise a call on its row count, the
 * attention arguments (tg_decode_args, also the fused step's per-layer view), and the
 * functions one family calls in another. Those are hidden (not exported); native.py
 * builds with link-time optimisation, so they inline across files as within one.
 * Exported names, argument orders and struct layouts are the ABI that native.py mirrors:
 * change them together with tg_abi_version() and native.ABI_VERSION.
 */
#ifndef TG_KERNELS_H
#define TG_KERNELS_H

#include <float.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* Functions shared between the families, kept out of the library's exported symbols. */
#define TG_INTERNAL __attribute__((visibility("hidden")))

/* Decode attention's arguments (the pool layout: attention.c), mirrored by
 * native.DecodeArgs; the fused step (decode_step.c) fills one per layer. */
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

/* 8 floats; loads and stores through it need no alignment. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8 x) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += x[i];
    return s;
}

/* Activation rows the few-rows GEMV loops take in one pass (gemv.c); more go in chunks of
 * this many (TG_CHUNKS). */
#define TG_MAX_M 8

static inline v8 load8(const float *p) { return *(const v8 *)p; }

/* A thread's scratch that grows to the largest request and is kept for the next call:
 * each caller holds its own __thread pointer and length. Returns NULL (and holds
 * nothing) when the memory is not there. */
static inline float *tg_thread_buffer(float **buf, int64_t *len, int64_t floats) {
    if (*len < floats) {
        free(*buf);
        *buf = malloc(sizeof(float) * (size_t)floats);
        *len = *buf ? floats : 0;
    }
    return *buf;
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
/* Rows a fused step takes (decode_step.c): decodes and the tokens of prefill chunks. */
#define TG_MAX_STEP_ROWS 2048
#define TG_CHUNKS(CALL)                                                                  \
    for (int64_t m0 = 0; m0 < M_all; m0 += TG_MAX_M) {                                   \
        const int64_t M = M_all - m0 < TG_MAX_M ? M_all - m0 : TG_MAX_M;                 \
        TG_SPLIT(CALL)                                                                   \
    }

/* ---- across families ---- */
/* attention.c */
TG_INTERNAL void store_heads(const tg_decode_args *a, int b, int h0, int h1);
TG_INTERNAL void attend(const tg_decode_args *a, int b, int h0, int h1);
TG_INTERNAL int chunk_ok(const tg_decode_args *a);
TG_INTERNAL int attend_chunk(const tg_decode_args *a, int b0, int n, int h);
/* gemv.c */
TG_INTERNAL void gemv_int8_rows(const float *x, int M, int64_t K, const int8_t *w, const uint16_t *scale, int64_t n0,
                                int64_t n1, float *y, int64_t ldy);
TG_INTERNAL void gemv_f32_rows(const float *x, int M, int64_t K, const float *w, int64_t n0, int64_t n1, float *y,
                               int64_t ldy);
TG_INTERNAL void gemv_int4_rows(const float *x, int M, int64_t K, const uint8_t *w, const uint16_t *scale,
                                const uint16_t *lo, int64_t G, const float *xsum, int64_t n0, int64_t n1, float *y,
                                int64_t ldy);
TG_INTERNAL int gemv_widened(const float *x, int64_t M_all, int64_t K, const int8_t *w8, const uint8_t *w4,
                             const uint16_t *scale, const uint16_t *lo, int64_t G, int64_t n0, int64_t n1, float *y,
                             int64_t ldy);
/* tiles.c */
TG_INTERNAL void gemm_f32_tiled(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y,
                                int64_t ldy);
/* bf16.c: weight rows per panel; the rows' bfloat16 copy; panels [p0, p1) of y */
#define TG_BF16_NR 32
TG_INTERNAL void bf16_rows(const float *x, int64_t m0, int64_t m1, int64_t K, uint16_t *xb);
TG_INTERNAL void bf16_panels(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t p0,
                             int64_t p1, float *y, int64_t ldy);
TG_INTERNAL void tg_thread_share(int64_t n, int64_t *a, int64_t *b);
/* ops.c */
TG_INTERNAL void rms_row(const float *in, float *res, const float *w, float *o, int64_t dim, float eps);
TG_INTERNAL void silu_row(const float *g, float *o, int64_t inter);

/* ---- the exported entry points (native.py declares their argument types) ---- */
int tg_decode_attention_f32(const tg_decode_args *a);
int tg_gemv_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int64_t ldy);
int tg_gemv_int8(const float *x, int64_t M_all, int64_t K, const int8_t *w, const uint16_t *scale, int64_t N,
                 float *y, int64_t ldy);
int tg_gemv_int4(const float *x, int64_t M_all, int64_t K, const uint8_t *w, const uint16_t *scale,
                 const uint16_t *lo, int64_t G, int64_t N, float *y, int64_t ldy);
void tg_quantize_int8(const float *w, int64_t N, int64_t K, const float *cand, int64_t J, int8_t *q, uint8_t *best);
void tg_dequant_int8(const int8_t *w, const uint16_t *scale, int64_t K, int64_t r0, int64_t r1, float *out);
void tg_dequant_int4(const uint8_t *w, const uint16_t *scale, const uint16_t *lo, int64_t K, int64_t G, int64_t r0,
                     int64_t r1, float *out);
void tg_rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                 float eps);
void tg_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter);
int tg_gemm_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int64_t ldy);
int64_t tg_isa(void);
double tg_peak(int64_t kind, int64_t iters);
int tg_abi_version(void);

#endif
