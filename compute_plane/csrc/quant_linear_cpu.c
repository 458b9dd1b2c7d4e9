/* Linear layers over weights that stay quantized in memory, for the CPU (quant.py).
 *
 * A decode step multiplies a few rows by every weight of the model: on a CPU it is
 * bound by the bytes read, so reading 4- or 8-bit weights instead of fp32 is the
 * largest speed lever there is. Two layouts, both in groups of 32 input channels:
 *
 *   q4: w[n][k] = s[n][g] * q + b[n][g], q in 0..15 (g = k / 32). Row n holds K/2 bytes,
 *       16 per group: byte j of a group has element j in its low nibble and element
 *       j + 16 in its high one (GGUF's Q4_0/Q4_1 order). sb[n][g] = {s, b}, fp32.
 *       GGUF Q4_0 (b = -8 d), Q4_1 (b = m) and Q4_K (per 32-group d*sc, -dmin*m) are
 *       exactly this.
 *   q8: w[n][k] = s[n][g] * q, q int8. GGUF Q8_0 exactly; wider formats re-quantized.
 *
 * y[m][n] = sum_g s * dot(q_g, x_g) + b * sum(x_g): the per-group sums of x are taken
 * once per call, in fp32. The dot products over the codes run in one of two ways:
 *
 *   exact (fp32): a group's 32 codes become four 8-float vectors that meet x with FMAs.
 *       The result is the dequantized weight's to fp32 rounding.
 *   int16: x is rounded once per call to int16 per group of 32 (x ~ dx * xq, |xq| <=
 *       32767, so the rounding is at most 2^-16 of the group's largest value), and the
 *       codes meet it in 16-bit integer multiply-adds (vpmaddwd): no int-to-float
 *       conversion per weight, ~1.2x faster for a whole decode step. llama.cpp rounds x to
 *       int8 (2^-8), which moves a greedy continuation within a few dozen tokens; int16's
 *       rounding is 256x finer (docs/performance.md has the measured effect).
 *
 * Rows n are spread over OpenMP threads (torch's libgomp, as the attention kernel). The
 * int16 kernel takes output channels in pairs and rows of x in fours: a pair's codes are
 * unpacked once per group for up to 4 rows and each row's x serves both channels, with
 * the 8 accumulators in registers; the q4 offsets are 8 groups per vector FMA. On the AMD
 * EPYC (2 cores) that is 1.2-1.6x the speed of one channel at a time with a scalar offset
 * per group (a decode step of 4 rows: 13.9 -> 9.9 ms). The exact kernel: a row's codes
 * serve up to CHUNK rows of x while in L1, 4 rows' accumulators in registers. Without
 * AVX2+FMA: plain C, exact. For many rows (prefill) quant.py
 * dequantizes a layer into fp32 with the *_dequant functions and uses oneDNN's GEMM.
 *
 * Layouts are contiguous; x [M][K], y [M][N]; K is a multiple of 32. M <= MAX_ROWS.
 * The linear functions return 0, 1 for a shape they do not take, 2 when out of memory.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define G 32
#define CHUNK 16    /* rows of x one pass over a weight row serves (accumulators) */
#define MAX_ROWS 128 /* quant.py dequantizes + GEMMs above this */

/* BLOCK(MB) over rows m of x in blocks of 4, then the 1-3 left: MB a constant in every
 * call, so each inlined block keeps its accumulators in registers. */
#define BY_FOURS(M, BLOCK)                    \
  int64_t m = 0;                              \
  for (; m + 4 <= (M); m += 4) BLOCK(4);      \
  switch ((M) - m) {                          \
    case 3: BLOCK(3); break;                  \
    case 2: BLOCK(2); break;                  \
    case 1: BLOCK(1); break;                  \
    default: break;                           \
  }

/* The 32 weights of a q4 group as floats (s * q + b is applied by the caller). */
static inline void unpack_q4(const uint8_t *p, float *out) {
  for (int j = 0; j < 16; ++j) out[j] = (float)(p[j] & 0x0F);
  for (int j = 0; j < 16; ++j) out[j + 16] = (float)(p[j] >> 4);
}

/* Per-group sums of x: xs[m][g]. */
static void group_sums(const float *x, int64_t M, int64_t K, float *xs) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float *xg = x + m * K + g * G;
      float s = 0.f;
      for (int j = 0; j < G; ++j) s += xg[j];
      xs[m * ng + g] = s;
    }
}

#ifdef HAVE_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* Rows of x as int16 per group of 32: x ~ dx[m][g] * xq[m][k], |xq| <= 32767. */
static void quantize_x16(const float *x, int64_t M, int64_t K, int16_t *xq, float *dx) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float *xg = x + m * K + g * G;
      float top = 0.f;
      for (int j = 0; j < G; ++j) top = fabsf(xg[j]) > top ? fabsf(xg[j]) : top;
      const float d = top / 32767.f, inv = top > 0.f ? 32767.f / top : 0.f;
      for (int j = 0; j < G; ++j) xq[m * K + g * G + j] = (int16_t)lrintf(xg[j] * inv);
      dx[m * ng + g] = d;
    }
}

/* Sum of codes * xq over a group: 16-bit products summed in pairs into 8 int32 lanes
 * (exact: |lane| <= 4 * 128 * 32767 < 2^24, so the float conversion is exact too). */
static inline __m256 group_dot16(__m256i w0, __m256i w1, const int16_t *xg) {
  const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xg));
  const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xg + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
}

/* Sum of codes * xq over a group as 8 int32 lanes: VNNI's multiply-add where the CPU has
 * it (one instruction fewer), else vpmaddwd + add; the same exact integers. */
static inline __m256i dot16_pair(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}
#endif

#ifndef HAVE_AVX2
/* One output channel n of a q4 weight over M rows of x: acc_out[m]; plain C. */
static void q4_row(const uint8_t *qn, const float *sbn, const float *x, const float *xs,
                   int64_t M, int64_t K, float *acc_out) {
  const int64_t ng = K / G;
  float w[G];
  for (int64_t m = 0; m < M; ++m) acc_out[m] = 0.f;
  for (int64_t g = 0; g < ng; ++g) {
    unpack_q4(qn + g * 16, w);
    const float s = sbn[2 * g], b = sbn[2 * g + 1];
    for (int64_t m = 0; m < M; ++m) {
      const float *xg = x + m * K + g * G;
      float d = 0.f;
      for (int j = 0; j < G; ++j) d += w[j] * xg[j];
      acc_out[m] += s * d + b * xs[m * ng + g];
    }
  }
}
#endif

#ifdef HAVE_AVX2
/* int16 arithmetic over a tile of NC (1 or 2) output channels x MB (1..4) rows of x, both
 * constants once inlined: a channel's unpacked codes serve MB rows and a row's x serves NC
 * channels, with the 2 x 4 accumulators in registers. The q4 offsets (b * sum x) take one
 * vector FMA per 8 groups, added into the same accumulators (a scalar multiply-add per
 * group and row cost a third of the kernel's time). */
static inline __attribute__((always_inline)) void q4_tile16(
    const uint8_t *qn, const float *sbn, int64_t K, const int16_t *xq, const float *dx,
    const float *xs, const int NC, const int MB, float *out, int64_t ldo) {
  const int64_t ng = K / G, qstride = K / 2, sstride = 2 * ng;
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 acc[2][4];
  for (int c = 0; c < 2; ++c)
    for (int m = 0; m < 4; ++m) acc[c][m] = _mm256_setzero_ps();
  float tail[2][4] = {{0.f}};
  /* The q4 offsets, b[c][g] * xs[m][g] summed over g: 8 groups per vector FMA (b taken
   * out of the interleaved {s, b} pairs), the last ng % 8 one at a time. */
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8)
    for (int c = 0; c < NC; ++c) {
      const float *p = sbn + c * sstride + 2 * g;
      const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
      const __m256 bv = _mm256_castpd_ps(_mm256_permute4x64_pd(
          _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
          _MM_SHUFFLE(3, 1, 2, 0)));
      for (int m = 0; m < MB; ++m)
        acc[c][m] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xs + m * ng + g), acc[c][m]);
    }
  for (; g < ng; ++g)
    for (int c = 0; c < NC; ++c)
      for (int m = 0; m < MB; ++m) tail[c][m] += sbn[c * sstride + 2 * g + 1] * xs[m * ng + g];
  for (g = 0; g < ng; ++g) {
    __m256i w0[2], w1[2];
    __m256 sv[2];
    for (int c = 0; c < NC; ++c) {
      const __m128i raw = _mm_loadu_si128((const __m128i *)(qn + c * qstride + g * 16));
      w0[c] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
      w1[c] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
      sv[c] = _mm256_broadcast_ss(sbn + c * sstride + 2 * g);
    }
    for (int m = 0; m < MB; ++m) {
      const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + m * K + g * G));
      const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + m * K + g * G + 16));
      const __m256 dxv = _mm256_broadcast_ss(dx + m * ng + g);
      for (int c = 0; c < NC; ++c) {
        const __m256 d = _mm256_cvtepi32_ps(dot16_pair(w0[c], w1[c], x0, x1));
        acc[c][m] = _mm256_fmadd_ps(d, _mm256_mul_ps(sv[c], dxv), acc[c][m]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int m = 0; m < MB; ++m) out[m * ldo + c] = hsum(acc[c][m]) + tail[c][m];
}

/* Output channels [n, n + nc) (nc <= 2) of a q4 weight over M rows of x: y[m][n + c]. */
static void q4_cols_int16(const uint8_t *qn, const float *sbn, const int16_t *xq,
                          const float *dx, const float *xs, int64_t M, int64_t K, int64_t nc,
                          float *y, int64_t N) {
  const int64_t ng = K / G;
#define Q4T(MB)                                                                          \
  do {                                                                                   \
    if (nc == 2)                                                                         \
      q4_tile16(qn, sbn, K, xq + m * K, dx + m * ng, xs + m * ng, 2, MB, y + m * N, N);  \
    else                                                                                 \
      q4_tile16(qn, sbn, K, xq + m * K, dx + m * ng, xs + m * ng, 1, MB, y + m * N, N);  \
  } while (0)
  BY_FOURS(M, Q4T)
#undef Q4T
}
#endif

#ifdef HAVE_AVX2
static inline __attribute__((always_inline)) void q8_block16(
    const int8_t *qn, const float *sn, const int16_t *xq, const float *dx, int64_t K,
    const int MB, float *out) {
  const int64_t ng = K / G;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t g = 0; g < ng; ++g) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + g * G)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + g * G + 16)));
    for (int m = 0; m < MB; ++m) {
      const __m256 d = group_dot16(w0, w1, xq + m * K + g * G);
      acc[m] = _mm256_fmadd_ps(d, _mm256_set1_ps(sn[g] * dx[m * ng + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
}

static void q8_row_int16(const int8_t *qn, const float *sn, const int16_t *xq, const float *dx,
                        int64_t M, int64_t K, float *out) {
  const int64_t ng = K / G;
#define Q8I(MB) q8_block16(qn, sn, xq + m * K, dx + m * ng, K, MB, out + m)
  BY_FOURS(M, Q8I)
#undef Q8I
}
#else
/* One output channel n of a q8 weight over M rows of x: acc_out[m]; plain C. */
static void q8_row(const int8_t *qn, const float *sn, const float *x, int64_t M, int64_t K,
                   float *acc_out) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m) acc_out[m] = 0.f;
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t m = 0; m < M; ++m) {
      const float *xg = x + m * K + g * G;
      float d = 0.f;
      for (int j = 0; j < G; ++j) d += (float)qn[g * G + j] * xg[j];
      acc_out[m] += sn[g] * d;
    }
}
#endif

#ifdef HAVE_AVX2
/* fp32 ("exact") arithmetic. The 32 codes of group g as four float vectors. */
static inline void q4_group(const uint8_t *qn, int64_t g, __m256 *w) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i raw = _mm_loadu_si128((const __m128i *)(qn + g * 16));
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  w[0] = u8_to_ps(lo), w[1] = u8_to_ps(_mm_srli_si128(lo, 8));
  w[2] = u8_to_ps(hi), w[3] = u8_to_ps(_mm_srli_si128(hi, 8));
}

static inline __m256 dot_group(const __m256 *w, const float *xg) {
  __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
  p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), p);
  p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), p);
  return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), p);
}

/* MB (1..4, a constant once inlined) rows of x against one q4 output channel, with the
 * accumulators in registers: no loop-carried trip through memory per group. */
static inline __attribute__((always_inline)) void q4_block(
    const uint8_t *qn, const float *sbn, const float *x, const float *xs, int64_t K,
    const int MB, float *out) {
  const int64_t ng = K / G;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  float accb[4] = {0.f, 0.f, 0.f, 0.f};
  __m256 w[4];
  for (int64_t g = 0; g < ng; ++g) {
    q4_group(qn, g, w);
    const __m256 sv = _mm256_set1_ps(sbn[2 * g]);
    const float b = sbn[2 * g + 1];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(sv, dot_group(w, x + m * K + g * G), acc[m]);
      accb[m] += b * xs[m * ng + g];
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + accb[m];
}

static void q4_row_exact(const uint8_t *qn, const float *sbn, const float *x, const float *xs,
                        int64_t M, int64_t K, float *out) {
  const int64_t ng = K / G;
#define Q4X(MB) q4_block(qn, sbn, x + m * K, xs + m * ng, K, MB, out + m)
  BY_FOURS(M, Q4X)
#undef Q4X
}

static inline __attribute__((always_inline)) void q8_block(
    const int8_t *qn, const float *sn, const float *x, int64_t K, const int MB, float *out) {
  const int64_t ng = K / G;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  __m256 w[4];
  for (int64_t g = 0; g < ng; ++g) {
    const __m128i a = _mm_loadu_si128((const __m128i *)(qn + g * G));
    const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * G + 16));
    w[0] = i8_to_ps(a), w[1] = i8_to_ps(_mm_srli_si128(a, 8));
    w[2] = i8_to_ps(b), w[3] = i8_to_ps(_mm_srli_si128(b, 8));
    const __m256 sv = _mm256_set1_ps(sn[g]);
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm256_fmadd_ps(sv, dot_group(w, x + m * K + g * G), acc[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
}
static void q8_row_exact(const int8_t *qn, const float *sn, const float *x, int64_t M,
                         int64_t K, float *out) {
#define Q8X(MB) q8_block(qn, sn, x + m * K, K, MB, out + m)
  BY_FOURS(M, Q8X)
#undef Q8X
}
#endif

/* The per-call preparation of x: its group sums (q4 offsets) and, for int16
 * arithmetic, its int16 form. One allocation. Without AVX2 the arithmetic is fp32. */
typedef struct {
  float *xs, *dx;
  int16_t *xq;
  int exact;
} Prepared;

static int prepare_x(const float *x, int64_t M, int64_t K, int sums, int exact, Prepared *p) {
  const int64_t ng = K / G;
#ifndef HAVE_AVX2
  exact = 1;
#endif
  char *mem = malloc(sizeof(float) * M * ng * 2 + (exact ? 0 : sizeof(int16_t) * M * K));
  if (!mem) return 2;
  p->exact = exact;
  p->xs = (float *)mem;
  p->dx = p->xs + M * ng;
  p->xq = (int16_t *)(p->dx + M * ng);
#ifdef HAVE_AVX2
  if (!exact) {
    quantize_x16(x, M, K, p->xq, p->dx);
    /* The q4 offsets meet the rounded x as well: the result is exactly the dequantized
     * weight times the rounded x (to fp32 rounding), which is what quant.py's GEMM path
     * computes for more rows, so a token's numerics do not depend on its batch. */
    if (sums)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < ng; ++g) {
          int32_t t = 0;
          for (int j = 0; j < G; ++j) t += p->xq[m * K + g * G + j];
          p->xs[m * ng + g] = p->dx[m * ng + g] * (float)t;
        }
    return 0;
  }
#endif
  if (sums) group_sums(x, M, K, p->xs);
  return 0;
}

/* 1 when the kernels round activations to int16 (AVX2 builds), else 0 (always exact). */
int int16_activations_supported(void) {
#ifdef HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}

int q4_linear_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *sb,
                  const float *bias, float *y, int64_t N, int exact) {
  if (M > MAX_ROWS || K % G) return 1;
  const int64_t ng = K / G;
  Prepared p;
  if (prepare_x(x, M, K, 1, exact, &p)) return 2;
#ifdef HAVE_AVX2
  if (!p.exact) { /* channels in pairs; a pair's codes stay in L1 across its rows */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += 2) {
      const int64_t nc = N - n < 2 ? N - n : 2;
      q4_cols_int16(q + n * (K / 2), sb + n * ng * 2, p.xq, p.dx, p.xs, M, K, nc, y + n, N);
      if (bias)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < nc; ++c) y[m * N + n + c] += bias[n + c];
    }
    free(p.xs);
    return 0;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float bn = bias ? bias[n] : 0.f;
    const uint8_t *qn = q + n * (K / 2);
    const float *sbn = sb + n * ng * 2;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) { /* the row's codes stay in L1 */
      const int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
      float acc[CHUNK];
#ifdef HAVE_AVX2
      q4_row_exact(qn, sbn, x + m0 * K, p.xs + m0 * ng, mc, K, acc);
#else
      q4_row(qn, sbn, x + m0 * K, p.xs + m0 * ng, mc, K, acc);
#endif
      for (int64_t m = 0; m < mc; ++m) y[(m0 + m) * N + n] = acc[m] + bn;
    }
  }
  free(p.xs);
  return 0;
}

int q8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                  const float *bias, float *y, int64_t N, int exact) {
  if (M > MAX_ROWS || K % G) return 1;
  const int64_t ng = K / G;
  Prepared p;
  if (prepare_x(x, M, K, 0, exact, &p)) return 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float bn = bias ? bias[n] : 0.f;
    const int8_t *qn = q + n * K;
    const float *sn = s + n * ng;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
      const int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
      float acc[CHUNK];
#ifdef HAVE_AVX2
      if (p.exact)
        q8_row_exact(qn, sn, x + m0 * K, mc, K, acc);
      else
        q8_row_int16(qn, sn, p.xq + m0 * K, p.dx + m0 * ng, mc, K, acc);
#else
      q8_row(qn, sn, x + m0 * K, mc, K, acc);
#endif
      for (int64_t m = 0; m < mc; ++m) y[(m0 + m) * N + n] = acc[m] + bn;
    }
  }
  free(p.xs);
  return 0;
}

/* Rows [r0, r0 + R) of a q4 weight as fp32, out [R][K] (the prefill path, embeddings). */
void q4_dequant_f32(const uint8_t *q, const float *sb, int64_t K, const int64_t *rows,
                    int64_t R, float *out) {
  const int64_t ng = K / G;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = rows[r];
    const uint8_t *qn = q + n * (K / 2);
    const float *sbn = sb + n * ng * 2;
    float *o = out + r * K;
    for (int64_t g = 0; g < ng; ++g) {
      unpack_q4(qn + g * (G / 2), o + g * G);
      const float s = sbn[2 * g], b = sbn[2 * g + 1];
      for (int j = 0; j < G; ++j) o[g * G + j] = s * o[g * G + j] + b;
    }
  }
}

void q8_dequant_f32(const int8_t *q, const float *s, int64_t K, const int64_t *rows, int64_t R,
                    float *out) {
  const int64_t ng = K / G;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = rows[r];
    const int8_t *qn = q + n * K;
    const float *sn = s + n * ng;
    float *o = out + r * K;
    for (int64_t g = 0; g < ng; ++g)
      for (int j = 0; j < G; ++j) o[g * G + j] = sn[g] * (float)qn[g * G + j];
  }
}
