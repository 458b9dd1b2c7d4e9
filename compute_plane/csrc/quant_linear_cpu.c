/* Linear layers over weights that stay quantized in memory, for the CPU (quant.py).
 *
 * A decode step multiplies a few rows by every weight of the model: on a CPU it is
 * bound by the bytes read, so reading 4- or 8-bit weights instead of fp32 is the
 * largest speed lever there is; a prefill or a speculative verification multiplies more
 * rows and is bound by the multiply-adds. Two kinds, both in groups of 32 input channels:
 *
 *   q4: w[n][k] = s[n][g] * q + b[n][g], q in 0..15 (g = k / 32). GGUF Q4_0 (b = -8 d),
 *       Q4_1 (b = m) and Q4_K (per 32-group d*sc, -dmin*m) are exactly this.
 *   q8: w[n][k] = s[n][g] * q, q int8. GGUF Q8_0 and Q5_0 (q = 8 (q5 - 16), s = d / 8)
 *       exactly; other formats re-quantized.
 *
 * Layout ("x16"): output channels in blocks of 16 (the last block padded with zeros),
 * so that one 512-bit vector holds a value for each of a block's 16 channels and no
 * dot product needs a horizontal sum. Block nb, group g:
 *
 *   q4 codes: 8 records of 32 bytes, record t for inputs 4t..4t+3 of the group:
 *       byte 2j   = channel j's input 4t   (low nibble) and 4t+2 (high nibble),
 *       byte 2j+1 = channel j's input 4t+1 (low nibble) and 4t+3 (high nibble);
 *       zero-extended to 16 bits, a record's low nibbles are the (4t, 4t+1) pairs of the
 *       16 channels and its high nibbles the (4t+2, 4t+3) pairs: what a 16-bit pairwise
 *       multiply-add (vpdpwssd / vpmaddwd) takes against x's pair broadcast.
 *       scales: 32, s of the 16 channels then b of the 16.
 *   q8 codes: 16 records of 32 bytes, record p: byte 2j, 2j+1 = channel j's inputs 2p,
 *       2p+1. scales: 16.
 *
 * Scales are fp32 or fp16 (`half`, one choice for a whole weight): GGUF's Q4_0, Q4_1,
 * Q5_0 and Q8_0 store theirs in fp16, so quant.py keeps them so where fp16 holds every
 * value exactly (a decode step is bound by the bytes it reads: 0.625 instead of 0.75 bytes a
 * weight for q4, 1.0625 instead of 1.125 for q8), and the result is the same bits as with
 * the same scales in fp32. Q4_K's products d * sc need fp32.
 *
 * q4_pack / q8_pack pack it, with fp32 scales (quant.py unpacks it and narrows the
 * scales). Arithmetic, two ways:
 *
 *   int16: x is rounded once per call to int16 per group of 32 (x ~ dx * xq, |xq| <=
 *       32767, so the rounding is at most 2^-16 of the group's largest value); a group's
 *       codes meet it in 16-bit integer multiply-adds summed exactly in int32, and
 *       y += (s * dx) * dot + b * sum(x_g) per group in fp32. llama.cpp rounds x to int8
 *       (2^-8), which moves a greedy continuation within a few dozen tokens; int16's
 *       rounding is 256x finer. A row's result does not depend on the other rows of the
 *       call (the same operations in the same order), so a token's numerics do not
 *       depend on its batch.
 *   exact (fp32): the codes become floats and meet x in fp32: the dequantized weight's
 *       result to fp32 rounding. AVX2 (8 channels a vector, up to 4 rows of x per pass
 *       over the codes; AVX-512 CPUs run it too), else plain C. A row's result does not
 *       depend on the other rows either.
 *
 * The int16 kernel is hand-vectorised for AVX-512 (a block's 16 channels in one vector,
 * up to 8 rows of x per pass over the codes, VNNI's vpdpwssd where the CPU has it) and
 * AVX2 (8 channels a vector, up to 4 rows); elsewhere plain C. On the AMD EPYC (2 cores)
 * the AVX-512 kernel is 2-2.9x the speed of the previous one (channels in rows, a
 * horizontal sum per group) at 1-120 rows for q|k|v and gate|up, 1.6-1.75x for down.
 * Blocks of channels are spread over OpenMP threads (torch's libgomp, as the attention
 * kernel).
 *
 * x [M][K], y [M][N], both contiguous; K is a multiple of 32. The linear functions return
 * 0, 1 for a shape they do not take, 2 when out of memory.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#endif

#define G 32
#define NB 16 /* output channels per block */
#define MAX_TILE 8

/* Scales: fp32, or fp16 when `half`. The offset of element i, and element i as fp32. */
static inline const void *sc_at(const void *sc, int half, int64_t i) {
  return (const char *)sc + i * (half ? 2 : 4);
}

static inline float h2f(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (e == 0) { /* zero or subnormal: man * 2^-24 */
    const float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  bits = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | (man << 13);
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

static inline float sc_get(const void *sc, int half, int64_t i) {
  return half ? h2f(((const uint16_t *)sc)[i]) : ((const float *)sc)[i];
}

#ifdef HAVE_AVX2
static inline __m256 sc_load8(const void *p, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))
              : _mm256_loadu_ps((const float *)p);
}
#endif

/* The per-call preparation of x: for int16, its int16 form xq with a scale dx per group
 * and sums xs = dx * sum(xq) (the q4 offsets meet the rounded x); for exact, xs = sum(x).
 * One allocation. */
typedef struct {
  float *xs, *dx;
  int16_t *xq;
} Prepared;

static int prepare_x(const float *x, int64_t M, int64_t K, int exact, Prepared *p) {
  const int64_t ng = K / G;
  char *mem = malloc(sizeof(float) * M * ng * 2 + (exact ? 0 : sizeof(int16_t) * M * K) + 64);
  if (!mem) return 2;
  p->xs = (float *)mem;
  p->dx = p->xs + M * ng;
  p->xq = (int16_t *)(p->dx + M * ng);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float *xg = x + m * K + g * G;
      if (exact) {
        float s = 0.f;
        for (int j = 0; j < G; ++j) s += xg[j];
        p->xs[m * ng + g] = s;
        continue;
      }
      float top = 0.f;
      for (int j = 0; j < G; ++j) top = fabsf(xg[j]) > top ? fabsf(xg[j]) : top;
      const float d = top / 32767.f, inv = top > 0.f ? 32767.f / top : 0.f;
      int16_t *xq = p->xq + m * K + g * G;
      int32_t t = 0;
      for (int j = 0; j < G; ++j) t += xq[j] = (int16_t)lrintf(xg[j] * inv);
      p->dx[m * ng + g] = d;
      p->xs[m * ng + g] = d * (float)t;
    }
  return 0;
}

/* ------------------------------------------------------------------ plain C */
/* n scales as floats. Not inlined: block_c holds no test of `half`, so its sums are one
 * copy of code that -ffast-math cannot compile differently for fp16 and fp32 scales (the
 * result is the same bits with either). */
static __attribute__((noinline)) void read_scales(const void *sc, int half, int n, float *out) {
  for (int j = 0; j < n; ++j) out[j] = sc_get(sc, half, j);
}

/* One block of 16 channels, one row of x: out[16]. kind 4 or 8; int16 or exact. */
static void block_c(int kind, int exact, const void *codes, const void *sc, int half, int64_t ng,
                    const float *x, const int16_t *xq, const float *dx, const float *xs,
                    float *out) {
  float acc[NB] = {0.f};
  for (int64_t g = 0; g < ng; ++g) {
    int32_t di[NB] = {0};
    float df[NB] = {0.f};
    if (kind == 4) {
      const uint8_t *qg = (const uint8_t *)codes + g * 256;
      for (int t = 0; t < 8; ++t)
        for (int j = 0; j < NB; ++j) {
          const int b0 = qg[t * 32 + 2 * j], b1 = qg[t * 32 + 2 * j + 1];
          const int c0 = b0 & 15, c1 = b1 & 15, c2 = b0 >> 4, c3 = b1 >> 4;
          if (exact) {
            const float *xk = x + g * G + 4 * t;
            df[j] += c0 * xk[0] + c1 * xk[1] + c2 * xk[2] + c3 * xk[3];
          } else {
            const int16_t *xk = xq + g * G + 4 * t;
            di[j] += c0 * xk[0] + c1 * xk[1] + c2 * xk[2] + c3 * xk[3];
          }
        }
    } else {
      const int8_t *qg = (const int8_t *)codes + g * 512;
      for (int p = 0; p < 16; ++p)
        for (int j = 0; j < NB; ++j) {
          const int c0 = qg[p * 32 + 2 * j], c1 = qg[p * 32 + 2 * j + 1];
          if (exact)
            df[j] += c0 * x[g * G + 2 * p] + c1 * x[g * G + 2 * p + 1];
          else
            di[j] += c0 * xq[g * G + 2 * p] + c1 * xq[g * G + 2 * p + 1];
        }
    }
    const int ns = kind == 4 ? 2 * NB : NB;
    const void *s = sc_at(sc, half, g * ns);
    float sv[2 * NB];
    read_scales(s, half, ns, sv);
    for (int j = 0; j < NB; ++j) {
      if (exact)
        acc[j] += sv[j] * df[j];
      else
        acc[j] += (float)di[j] * (sv[j] * dx[g]);
      if (kind == 4) acc[j] += sv[NB + j] * xs[g];
    }
  }
  memcpy(out, acc, sizeof acc);
}

/* ------------------------------------------------------------------ AVX-512 */
#ifdef HAVE_AVX512
static inline __m512i dot_pairs512(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

static inline __m512 sc_load16(const void *p, int half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p))
              : _mm512_loadu_ps((const float *)p);
}

/* MB (1..8, a constant once inlined) rows of x against one block: out[m * ldo + j]. */
static inline __attribute__((always_inline)) void tile512(
    int kind, const void *codes, const void *sc, int half, int64_t ng, const int16_t *xq,
    const float *dx, const float *xs, int64_t K, const int MB, float *out, int64_t ldo) {
  __m512 acc[MAX_TILE];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < ng; ++g) {
    __m512i ia[MAX_TILE];
    for (int m = 0; m < MB; ++m) ia[m] = _mm512_setzero_si512();
    if (kind == 4) {
      const uint8_t *qg = (const uint8_t *)codes + g * 256;
      for (int t = 0; t < 8; ++t) {
        const __m512i raw =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qg + t * 32)));
        const __m512i w01 = _mm512_and_si512(raw, mask), w23 = _mm512_srli_epi16(raw, 4);
        for (int m = 0; m < MB; ++m) {
          int32_t x01, x23; /* x's pairs (4t, 4t+1) and (4t+2, 4t+3) */
          memcpy(&x01, xq + m * K + g * G + 4 * t, 4);
          memcpy(&x23, xq + m * K + g * G + 4 * t + 2, 4);
          ia[m] = dot_pairs512(ia[m], w01, _mm512_set1_epi32(x01));
          ia[m] = dot_pairs512(ia[m], w23, _mm512_set1_epi32(x23));
        }
      }
    } else {
      const int8_t *qg = (const int8_t *)codes + g * 512;
      for (int p = 0; p < 16; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qg + p * 32)));
        for (int m = 0; m < MB; ++m) {
          int32_t xp;
          memcpy(&xp, xq + m * K + g * G + 2 * p, 4);
          ia[m] = dot_pairs512(ia[m], w, _mm512_set1_epi32(xp));
        }
      }
    }
    const void *s = sc_at(sc, half, g * (kind == 4 ? 2 * NB : NB));
    const __m512 sv = sc_load16(s, half);
    const __m512 bv = kind == 4 ? sc_load16(sc_at(s, half, NB), half) : sv;
    for (int m = 0; m < MB; ++m) {
      const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(dx[m * ng + g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), scale, acc[m]);
      if (kind == 4) acc[m] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xs[m * ng + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}
#define TILE_ROWS 8
#define TILE(KIND, MB, OUT, LDO) \
  tile512(KIND, c, s, half, ng, p->xq + m * K, p->dx + m * ng, p->xs + m * ng, K, MB, OUT, LDO)

/* ------------------------------------------------------------------ AVX2 */
#elif defined(HAVE_AVX2)
static inline __m256i dot_pairs256(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

/* Half h of a block (channels 8h..8h+7), MB (1..4) rows: out[m * ldo + j]. */
static inline __attribute__((always_inline)) void half256(
    int kind, const void *codes, const void *sc, int half, int64_t ng, const int16_t *xq,
    const float *dx, const float *xs, int64_t K, const int MB, int h, float *out,
    int64_t ldo) {
  __m256 acc[4];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi16(0x0F);
  for (int64_t g = 0; g < ng; ++g) {
    __m256i ia[4];
    for (int m = 0; m < MB; ++m) ia[m] = _mm256_setzero_si256();
    if (kind == 4) {
      const uint8_t *qg = (const uint8_t *)codes + g * 256 + 16 * h;
      for (int t = 0; t < 8; ++t) {
        const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qg + t * 32)));
        const __m256i w01 = _mm256_and_si256(raw, mask), w23 = _mm256_srli_epi16(raw, 4);
        for (int m = 0; m < MB; ++m) {
          int32_t x01, x23;
          memcpy(&x01, xq + m * K + g * G + 4 * t, 4);
          memcpy(&x23, xq + m * K + g * G + 4 * t + 2, 4);
          ia[m] = dot_pairs256(ia[m], w01, _mm256_set1_epi32(x01));
          ia[m] = dot_pairs256(ia[m], w23, _mm256_set1_epi32(x23));
        }
      }
    } else {
      const int8_t *qg = (const int8_t *)codes + g * 512 + 16 * h;
      for (int p = 0; p < 16; ++p) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qg + p * 32)));
        for (int m = 0; m < MB; ++m) {
          int32_t xp;
          memcpy(&xp, xq + m * K + g * G + 2 * p, 4);
          ia[m] = dot_pairs256(ia[m], w, _mm256_set1_epi32(xp));
        }
      }
    }
    const void *s = sc_at(sc, half, g * (kind == 4 ? 2 * NB : NB) + 8 * h);
    const __m256 sv = sc_load8(s, half);
    const __m256 bv = kind == 4 ? sc_load8(sc_at(s, half, NB), half) : sv;
    for (int m = 0; m < MB; ++m) {
      const __m256 scale = _mm256_mul_ps(sv, _mm256_set1_ps(dx[m * ng + g]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), scale, acc[m]);
      if (kind == 4) acc[m] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xs[m * ng + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m]);
}
#define TILE_ROWS 4
#define TILE(KIND, MB, OUT, LDO)                                                               \
  do {                                                                                        \
    half256(KIND, c, s, half, ng, p->xq + m * K, p->dx + m * ng, p->xs + m * ng, K, MB, 0, OUT, \
            LDO);                                                                             \
    half256(KIND, c, s, half, ng, p->xq + m * K, p->dx + m * ng, p->xs + m * ng, K, MB, 1, OUT, \
            LDO);                                                                             \
  } while (0)
#endif

/* ------------------------------------------------------------------ exact, AVX2 */
#ifdef HAVE_AVX2
/* fp32 x: half h of a block (channels 8h..8h+7), MB (1..4) rows: out[m * ldo + j]. Each
 * code becomes a float once per pass and meets every row's x in a fused multiply-add; a
 * row's operations are the same whatever MB is. (AVX-512 CPUs run this too.) */
static inline __attribute__((always_inline)) void half256_exact(
    int kind, const void *codes, const void *sc, int half, int64_t ng, const float *x,
    const float *xs, int64_t K, const int MB, int h, float *out, int64_t ldo) {
  __m256 acc[4];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < ng; ++g) {
    __m256 df[4];
    for (int m = 0; m < MB; ++m) df[m] = _mm256_setzero_ps();
    const float *xg = x + g * G;
    if (kind == 4) {
      const uint8_t *qg = (const uint8_t *)codes + g * 256 + 16 * h;
      for (int t = 0; t < 8; ++t) {
        /* lane j: channel 8h+j's bytes 2j | 2j+1 << 8, i.e. its codes for inputs 4t
         * (bits 0-3), 4t+2 (4-7), 4t+1 (8-11) and 4t+3 (12-15) */
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(qg + t * 32)));
        const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
        const __m256 c2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble));
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble));
        const __m256 c3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12));
        for (int m = 0; m < MB; ++m) {
          const float *xk = xg + m * K + 4 * t;
          df[m] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xk), df[m]);
          df[m] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xk + 1), df[m]);
          df[m] = _mm256_fmadd_ps(c2, _mm256_broadcast_ss(xk + 2), df[m]);
          df[m] = _mm256_fmadd_ps(c3, _mm256_broadcast_ss(xk + 3), df[m]);
        }
      }
    } else {
      const int8_t *qg = (const int8_t *)codes + g * 512 + 16 * h;
      for (int p = 0; p < 16; ++p) {
        /* lane j: channel 8h+j's int8 codes for inputs 2p (bits 0-7) and 2p+1 (8-15) */
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(qg + p * 32)));
        const __m256 c0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
        for (int m = 0; m < MB; ++m) {
          const float *xk = xg + m * K + 2 * p;
          df[m] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xk), df[m]);
          df[m] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xk + 1), df[m]);
        }
      }
    }
    const void *s = sc_at(sc, half, g * (kind == 4 ? 2 * NB : NB) + 8 * h);
    const __m256 sv = sc_load8(s, half);
    const __m256 bv = kind == 4 ? sc_load8(sc_at(s, half, NB), half) : sv;
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(sv, df[m], acc[m]);
      if (kind == 4) acc[m] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xs[m * ng + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m]);
}
#define EXACT_ROWS 4
#define EXACT(KIND, MB, OUT, LDO)                                                     \
  do {                                                                                \
    half256_exact(KIND, c, s, half, ng, x + m * K, p->xs + m * ng, K, MB, 0, OUT, LDO); \
    half256_exact(KIND, c, s, half, ng, x + m * K, p->xs + m * ng, K, MB, 1, OUT, LDO); \
  } while (0)
#endif

/* Rows [0, M) of x against block nb: out[m * ldo + j], j < 16. */
static void run_block(int kind, int exact, const void *codes, const void *scales, int half,
                      int64_t nb, const float *x, const Prepared *p, int64_t M, int64_t K,
                      float *out, int64_t ldo) {
  const int64_t ng = K / G;
  const void *c = (const char *)codes + nb * ng * (kind == 4 ? 256 : 512);
  const void *s = sc_at(scales, half, nb * ng * (kind == 4 ? 2 * NB : NB));
#ifdef TILE
  if (!exact) {
    int64_t m = 0;
    for (; m + TILE_ROWS <= M; m += TILE_ROWS) TILE(kind, TILE_ROWS, out + m * ldo, ldo);
    switch (M - m) { /* MB a constant in each call: accumulators stay in registers */
#if TILE_ROWS > 4
      case 7: TILE(kind, 7, out + m * ldo, ldo); break;
      case 6: TILE(kind, 6, out + m * ldo, ldo); break;
      case 5: TILE(kind, 5, out + m * ldo, ldo); break;
      case 4: TILE(kind, 4, out + m * ldo, ldo); break;
#endif
      case 3: TILE(kind, 3, out + m * ldo, ldo); break;
      case 2: TILE(kind, 2, out + m * ldo, ldo); break;
      case 1: TILE(kind, 1, out + m * ldo, ldo); break;
      default: break;
    }
    return;
  }
#endif
#ifdef EXACT
  if (exact) {
    int64_t m = 0;
    for (; m + EXACT_ROWS <= M; m += EXACT_ROWS) EXACT(kind, EXACT_ROWS, out + m * ldo, ldo);
    switch (M - m) {
      case 3: EXACT(kind, 3, out + m * ldo, ldo); break;
      case 2: EXACT(kind, 2, out + m * ldo, ldo); break;
      case 1: EXACT(kind, 1, out + m * ldo, ldo); break;
      default: break;
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    block_c(kind, exact, c, s, half, ng, x + m * K, exact ? NULL : p->xq + m * K, p->dx + m * ng,
            p->xs + m * ng, out + m * ldo);
}

static int linear(int kind, const float *x, int64_t M, int64_t K, const void *codes,
                  const void *scales, int half, const float *bias, float *y, int64_t N,
                  int exact) {
  if (K % G || M < 0) return 1;
  Prepared p;
  if (prepare_x(x, M, K, exact, &p)) return 2;
  const int64_t nblocks = (N + NB - 1) / NB;
  int failed = 0;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nblocks; ++nb) {
    const int64_t n0 = nb * NB, nc = N - n0 < NB ? N - n0 : NB;
    if (nc == NB) {
      run_block(kind, exact, codes, scales, half, nb, x, &p, M, K, y + n0, N);
    } else { /* the padded last block: through a buffer */
      float *tmp = malloc(sizeof(float) * NB * (M > 0 ? M : 1));
      if (!tmp) {
        failed = 1;
        continue;
      }
      run_block(kind, exact, codes, scales, half, nb, x, &p, M, K, tmp, NB);
      for (int64_t m = 0; m < M; ++m) memcpy(y + m * N + n0, tmp + m * NB, sizeof(float) * nc);
      free(tmp);
    }
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nc; ++j) y[m * N + n0 + j] += bias[n0 + j];
  }
  free(p.xs);
  return failed ? 2 : 0;
}

/* sc: fp32 scales, or fp16 when `half`. */
int q4_linear_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, const void *sc,
                  int half, const float *bias, float *y, int64_t N, int exact) {
  return linear(4, x, M, K, q, sc, half, bias, y, N, exact);
}

int q8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const void *sc,
                  int half, const float *bias, float *y, int64_t N, int exact) {
  return linear(8, x, M, K, q, sc, half, bias, y, N, exact);
}

/* The row layout -> the x16 layout above (quant.py's QuantWeight.pack). Row layout:
 * q4 codes [N][K/2] (byte j of a group: element j in the low, j + 16 in the high nibble),
 * scales [N][K/32][2] = (s, b); q8 codes [N][K], scales [N][K/32]. Packed channel r is
 * row rows[r] (rows NULL: row r), so a permutation costs nothing more; the padding
 * channels of the last block are zero. out_codes / out_scales hold ceil(N/16) blocks. */
void q4_pack(const uint8_t *codes, const float *scales, int64_t N, int64_t K,
             const int64_t *rows, uint8_t *out_codes, float *out_scales) {
  const int64_t ng = K / G, blocks = (N + NB - 1) / NB;
  memset(out_codes, 0, (size_t)(blocks * ng * 256));
  memset(out_scales, 0, (size_t)(blocks * ng * 2 * NB) * sizeof(float));
#pragma omp parallel for schedule(static) if (N * K > (1 << 20))
  for (int64_t r = 0; r < N; ++r) {
    const int64_t src = rows ? rows[r] : r, nb = r / NB, j = r % NB;
    const uint8_t *c = codes + src * (K / 2);
    const float *s = scales + src * ng * 2;
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t *cg = c + g * 16;
      uint8_t v[G];
      for (int e = 0; e < 16; ++e) v[e] = cg[e] & 15, v[e + 16] = cg[e] >> 4;
      uint8_t *o = out_codes + (nb * ng + g) * 256;
      for (int t = 0; t < 8; ++t) {
        o[t * 32 + 2 * j] = (uint8_t)(v[4 * t] | (v[4 * t + 2] << 4));
        o[t * 32 + 2 * j + 1] = (uint8_t)(v[4 * t + 1] | (v[4 * t + 3] << 4));
      }
      float *os = out_scales + (nb * ng + g) * 2 * NB;
      os[j] = s[2 * g], os[NB + j] = s[2 * g + 1];
    }
  }
}

void q8_pack(const int8_t *codes, const float *scales, int64_t N, int64_t K, const int64_t *rows,
             int8_t *out_codes, float *out_scales) {
  const int64_t ng = K / G, blocks = (N + NB - 1) / NB;
  memset(out_codes, 0, (size_t)(blocks * ng * 512));
  memset(out_scales, 0, (size_t)(blocks * ng * NB) * sizeof(float));
#pragma omp parallel for schedule(static) if (N * K > (1 << 20))
  for (int64_t r = 0; r < N; ++r) {
    const int64_t src = rows ? rows[r] : r, nb = r / NB, j = r % NB;
    const int8_t *c = codes + src * K;
    for (int64_t g = 0; g < ng; ++g) {
      int8_t *o = out_codes + (nb * ng + g) * 512;
      for (int p = 0; p < 16; ++p) {
        o[p * 32 + 2 * j] = c[g * G + 2 * p];
        o[p * 32 + 2 * j + 1] = c[g * G + 2 * p + 1];
      }
      out_scales[(nb * ng + g) * NB + j] = scales[src * ng + g];
    }
  }
}

/* Channels rows[0..R) of a weight as fp32, out [R][K] (embeddings, dense fallbacks). */
void q4_dequant_f32(const uint8_t *q, const void *sc, int half, int64_t K,
                    const int64_t *rows, int64_t R, float *out) {
  const int64_t ng = K / G;
#pragma omp parallel for schedule(static) if (R > 16)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nb = rows[r] / NB, j = rows[r] % NB;
    float *o = out + r * K;
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t *qg = q + (nb * ng + g) * 256;
      const void *s = sc_at(sc, half, (nb * ng + g) * 2 * NB);
      const float sj = sc_get(s, half, j), bj = sc_get(s, half, NB + j);
      for (int t = 0; t < 8; ++t) {
        const int b0 = qg[t * 32 + 2 * j], b1 = qg[t * 32 + 2 * j + 1];
        float *ok = o + g * G + 4 * t;
        ok[0] = sj * (float)(b0 & 15) + bj, ok[1] = sj * (float)(b1 & 15) + bj;
        ok[2] = sj * (float)(b0 >> 4) + bj, ok[3] = sj * (float)(b1 >> 4) + bj;
      }
    }
  }
}

void q8_dequant_f32(const int8_t *q, const void *sc, int half, int64_t K, const int64_t *rows,
                    int64_t R, float *out) {
  const int64_t ng = K / G;
#pragma omp parallel for schedule(static) if (R > 16)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nb = rows[r] / NB, j = rows[r] % NB;
    float *o = out + r * K;
    for (int64_t g = 0; g < ng; ++g) {
      const int8_t *qg = q + (nb * ng + g) * 512;
      const float sj = sc_get(sc, half, (nb * ng + g) * NB + j);
      for (int p = 0; p < 16; ++p) {
        o[g * G + 2 * p] = sj * (float)qg[p * 32 + 2 * j];
        o[g * G + 2 * p + 1] = sj * (float)qg[p * 32 + 2 * j + 1];
      }
    }
  }
}

/* Which int16 kernel this build runs: 2 AVX-512, 1 AVX2, 0 plain C. */
int int16_kernel_kind(void) {
#if defined(HAVE_AVX512)
  return 2;
#elif defined(HAVE_AVX2)
  return 1;
#else
  return 0;
#endif
}
