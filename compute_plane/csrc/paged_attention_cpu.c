/* Decode attention over a paged fp32 KV cache, for the CPU backend (attention_cpu.py).
 *
 * One query token per sequence attends to its whole context, read block by block where
 * it lies in the cache: no gather into a padded copy, no mask. A work item is a
 * sequence (or, for batches too small to keep every thread busy, one KV head of a
 * sequence): the scores of its query heads over the context, a softmax, then the
 * weighted sum of V. Walking a whole slot row (all KV heads) at once reads each block
 * as one contiguous run, twice as fast as a head at a time once the cache outgrows L3.
 * While it reads one block it prefetches the next block of the table, a row per token:
 * the blocks lie scattered, so the hardware prefetcher cannot guess the next one
 * (decodes at 64 x 300 tokens from DRAM: 13 -> 19 GB/s).
 *
 * Items are spread over OpenMP threads. The library links libgomp, which resolves to
 * the copy torch has already loaded, so the kernel shares torch's thread pool instead
 * of fighting it for cores. Compiled at first use with -O3 -march=native -ffast-math:
 * the dot products, axpys and expf vectorise.
 *
 * Layouts (contiguous): q, out [D, H, hd]; k_cache, v_cache [N, bs, KVH, hd];
 * tables [D, table_stride] int32 block ids; seq_lens [D] int32 (>= 1). window > 0: a
 * sliding-window layer's, each query sees only the last `window` tokens (blocks before
 * them are not read: their ids may be stale); 0: all.
 * Returns 0, or 1 when a thread could not allocate its score buffer.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* Sum of a[i] * b[i] over n floats: eight independent lanes, so the FMAs pipeline. */
static inline float dot(const float *a, const float *b, int64_t n) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 8; ++l) s += lane[l];
  return s;
}

/* Ask for the cache lines of one slot row (n floats) ahead of their use. */
static inline void prefetch_row(const float *row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i, 0, 3);
}

typedef struct {
  int64_t num_heads, group, slot_stride, head_dim, block_size;
  float scale;
} Shape;

/* Query heads [h0, h1) of one sequence (q, o point at its head 0) over its tokens
 * [first, len): all of them, or the last `window` for a sliding-window layer. */
static void attend(const Shape *s, const float *q, float *o, const float *k_cache,
                   const float *v_cache, const int32_t *table, int64_t first, int64_t len,
                   int64_t h0, int64_t h1, float *scores) {
  const int64_t hd = s->head_dim, bs = s->block_size;
  const int64_t num_blocks = (len + bs - 1) / bs, n_keys = len - first;
  const int64_t block_stride = bs * s->slot_stride;
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const int64_t t0 = b * bs;
    const int64_t n = len - t0 < bs ? len - t0 : bs;
    const float *k = k_cache + (int64_t)table[b] * block_stride;
    const float *next = b + 1 < num_blocks ? k_cache + (int64_t)table[b + 1] * block_stride : NULL;
    for (int64_t t = 0; t < n; ++t, k += s->slot_stride) {
      if (next) prefetch_row(next + t * s->slot_stride, s->slot_stride);
      if (t0 + t < first) continue;
      for (int64_t h = h0; h < h1; ++h)
        scores[(h - h0) * n_keys + t0 + t - first] =
            dot(q + h * hd, k + (h / s->group) * hd, hd) * s->scale;
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    float *sh = scores + (h - h0) * n_keys;
    float top = -FLT_MAX;
    for (int64_t t = 0; t < n_keys; ++t) top = sh[t] > top ? sh[t] : top;
    float sum = 0.f;
    for (int64_t t = 0; t < n_keys; ++t) {
      sh[t] = expf(sh[t] - top);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n_keys; ++t) sh[t] *= inv;
  }
  for (int64_t i = h0 * hd; i < h1 * hd; ++i) o[i] = 0.f;
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const int64_t t0 = b * bs;
    const int64_t n = len - t0 < bs ? len - t0 : bs;
    const float *v = v_cache + (int64_t)table[b] * block_stride;
    const float *next = b + 1 < num_blocks ? v_cache + (int64_t)table[b + 1] * block_stride : NULL;
    for (int64_t t = 0; t < n; ++t, v += s->slot_stride) {
      if (next) prefetch_row(next + t * s->slot_stride, s->slot_stride);
      if (t0 + t < first) continue;
      for (int64_t h = h0; h < h1; ++h) {
        const float p = scores[(h - h0) * n_keys + t0 + t - first];
        const float *vh = v + (h / s->group) * hd;
        float *oh = o + h * hd;
        for (int64_t i = 0; i < hd; ++i) oh[i] += p * vh[i];
      }
    }
  }
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *tables, int64_t table_stride,
                               const int32_t *seq_lens, float *out, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, int64_t window) {
  const Shape s = {num_heads, num_heads / num_kv_heads, num_kv_heads * head_dim, head_dim,
                   block_size, scale};
  /* Whole sequences per item when there are enough to share out; else one KV head each. */
  const int64_t parts = num_seqs >= 4 * omp_get_max_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_part = num_heads / parts;
  int64_t longest = 1;
  for (int64_t d = 0; d < num_seqs; ++d) longest = seq_lens[d] > longest ? seq_lens[d] : longest;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    float *scores = malloc(sizeof(float) * (size_t)(heads_per_part * longest));
    failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * parts; ++item) {
      if (failed) continue;
      const int64_t d = item / parts, h0 = (item % parts) * heads_per_part;
      const int64_t len = seq_lens[d];
      const int64_t first = window > 0 && len > window ? len - window : 0;
      attend(&s, q + d * num_heads * head_dim, out + d * num_heads * head_dim, k_cache,
             v_cache, tables + d * table_stride, first, len, h0, h0 + heads_per_part, scores);
    }
    free(scores);
  }
  return failed;
}
