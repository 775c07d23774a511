/* What the library was compiled for, and the peak rate of its multiply-add instructions.
 *
 * native.py compiles the kernels for the CPU they run on (-march=native), so the
 * instruction sets compiled in are the ones this CPU has: tg_isa reports them (the
 * engine and the benches read it; the kernels pick their paths with the same macros).
 * tg_peak runs one kind of multiply-add on every thread of an OpenMP team, 12
 * independent accumulators per thread (enough chains to hide the instructions'
 * latency), and returns operations per second (a multiply-add counts two): the
 * machine's arithmetic ceiling, against which the benches put what a step achieves.
 */
#include "tg_kernels.h"

enum { TG_ISA_AVX2 = 1, TG_ISA_AVX512 = 2, TG_ISA_AVX512_BF16 = 4, TG_ISA_AVX512_VNNI = 8, TG_ISA_AVX_VNNI = 16 };

int64_t tg_isa(void) {
    int64_t f = 0;
#if defined(__AVX2__) && defined(__FMA__)
    f |= TG_ISA_AVX2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    f |= TG_ISA_AVX512;
#endif
#if defined(__AVX512BF16__)
    f |= TG_ISA_AVX512_BF16;
#endif
#if defined(__AVX512VNNI__)
    f |= TG_ISA_AVX512_VNNI;
#endif
#if defined(__AVXVNNI__)
    f |= TG_ISA_AVX_VNNI;
#endif
    return f;
}

#define TG_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
/* Keeps the compiler from hoisting the loop-invariant operand out of the loop. */
#if defined(__GNUC__) && defined(__AVX__)
#define TG_OPAQUE(v) __asm__("" : "+x"(v))
#else
#define TG_OPAQUE(v) (void)0
#endif

/* Operations one thread does in `iters` iterations of `kind` (0 float32 FMA, 1 bfloat16
 * dot product, 2 int8 dot product), or -1 when the library has no such instruction. */
static double peak_loop(int64_t kind, int64_t iters, float *sink) {
    float s = 0.f;
    if (kind == 0) {
#if defined(__AVX512F__)
#define TG_D(i) __m512 a##i = _mm512_set1_ps((float)i);
        TG_R12(TG_D)
        __m512 b = _mm512_set1_ps(0.5f), c = _mm512_set1_ps(0.5f);
        for (int64_t it = 0; it < iters; it++) {
#define TG_F(i) a##i = _mm512_fmadd_ps(a##i, b, c);
            TG_R12(TG_F)
            TG_OPAQUE(b);
        }
#define TG_S(i) s += _mm512_reduce_add_ps(a##i);
        TG_R12(TG_S)
        *sink = s;
        return (double)iters * 12 * 32;
#else
#define TG_D8(i) v8 a##i = {(float)i};
        TG_R12(TG_D8)
        v8 b = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, c = b;
        for (int64_t it = 0; it < iters; it++) {
#define TG_F8(i) a##i = a##i * b + c;
            TG_R12(TG_F8)
            TG_OPAQUE(b);
        }
#define TG_S8(i) s += hsum8(a##i);
        TG_R12(TG_S8)
        *sink = s;
        return (double)iters * 12 * 16;
#endif
    }
    if (kind == 1) {
#if defined(__AVX512BF16__)
#define TG_DB(i) __m512 d##i = _mm512_setzero_ps();
        TG_R12(TG_DB)
        __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = x;
        for (int64_t it = 0; it < iters; it++) {
#define TG_B(i) d##i = _mm512_dpbf16_ps(d##i, x, y);
            TG_R12(TG_B)
            TG_OPAQUE(x);
        }
#define TG_SB(i) s += _mm512_reduce_add_ps(d##i);
        TG_R12(TG_SB)
        *sink = s;
        return (double)iters * 12 * 64;
#endif
    }
    if (kind == 2) {
#if defined(__AVX512VNNI__)
#define TG_DV(i) __m512i e##i = _mm512_setzero_si512();
        TG_R12(TG_DV)
        __m512i u = _mm512_set1_epi8(1), v = u;
        for (int64_t it = 0; it < iters; it++) {
#define TG_V(i) e##i = _mm512_dpbusd_epi32(e##i, u, v);
            TG_R12(TG_V)
            TG_OPAQUE(u);
        }
#define TG_SV(i) s += (float)_mm512_reduce_add_epi32(e##i);
        TG_R12(TG_SV)
        *sink = s;
        return (double)iters * 12 * 128;
#elif defined(__AVXVNNI__)
#define TG_DW(i) __m256i e##i = _mm256_setzero_si256();
        TG_R12(TG_DW)
        __m256i u = _mm256_set1_epi8(1), v = u;
        for (int64_t it = 0; it < iters; it++) {
#define TG_W(i) e##i = _mm256_dpbusd_avx_epi32(e##i, u, v);
            TG_R12(TG_W)
            TG_OPAQUE(u);
        }
#define TG_SW(i) s += (float)_mm256_extract_epi32(e##i, 0);
        TG_R12(TG_SW)
        *sink = s;
        return (double)iters * 12 * 64;
#endif
    }
    return -1.0;
}

/* Operations per second of `kind` over the whole team (every thread runs `iters`
 * iterations; the time is the region's wall time), or -1 when there is no such
 * instruction. */
double tg_peak(int64_t kind, int64_t iters) {
    float sink[256] = {0};
    double ops = 0.0;
    const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : ops)
    ops += peak_loop(kind, iters, sink + (omp_get_thread_num() & 255));
    const double t = omp_get_wtime() - t0;
    if (ops < 0 || t <= 0) return -1.0;
    return ops / t + 0.f * sink[0];
}
