/* A whole decode step of a Llama-family model in one call, for the CPU (decode_cpu.py).
 *
 * At batch 1 the torch forward spends as long dispatching its ~20 small operations per
 * layer (norms, rotary, cache writes, views, activations) as its matmuls take to stream
 * the weights. Here a step's M decode rows (one token each) run every layer in C:
 *
 *   h = embed(ids)
 *   per layer: x = rmsnorm(h); qkv = x W_qkv (+ b); [q, k per-head rmsnorm]; rotary;
 *              k, v -> cache slots; a = attention(q, cache); h += a W_o;
 *              x = rmsnorm(h); h += (silu(x W_gate) * x W_up) W_down
 *   out = rmsnorm(h)
 *
 * with the quantized linears of quant_linear_cpu.c and the paged attention of
 * paged_attention_cpu.c (both included: one library, their OpenMP loops on torch's
 * libgomp pool). Arithmetic is fp32 in the same order of operations as model.py, so
 * the result is the torch forward's to rounding. The small elementwise work runs on
 * the calling thread: at M <= 128 rows it is microseconds.
 *
 * Returns 0; 1 for a shape the linears do not take (M > MAX_DECODE_ROWS, K % 32); 2 when out
 * of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention_cpu.c"
#include "quant_linear_cpu.c"

enum { W_DENSE = 0, W_Q4 = 1, W_Q8 = 2 };
#define MAX_DECODE_ROWS 128 /* decode_cpu.py's FusedDecode.max_rows */

/* A weight [n][k]: dense fp32 rows, or the q4 / q8 layouts of quant_linear_cpu.c (scales
 * fp16 when `half`, else fp32). */
typedef struct {
  int64_t kind, n, k, half;
  const void *codes;
  const void *scales;
  const float *bias; /* NULL or [n] */
} DWeight;

typedef struct {
  const float *input_norm, *post_norm; /* post_norm: the norm before the MLP */
  const float *q_norm, *k_norm; /* NULL unless the model norms q and k per head */
  DWeight qkv, o, gate_up, down;
  float *k_cache, *v_cache; /* [blocks][block_size][kv_heads][head_dim] */
  const float *cos, *sin;   /* this layer's rotary tables [max_positions][head_dim] */
  int64_t window;           /* > 0: sees only the last `window` positions */
  const float *attn_out_norm, *mlp_out_norm; /* Gemma's sandwich; NULL otherwise */
} DLayer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
  int64_t num_layers, hidden, intermediate, heads, kv_heads, head_dim, block_size;
  int64_t exact; /* fp32 activations in the linears (else int16) */
  float eps, scale;
  DWeight embed;
  float embed_scale; /* embeddings multiplied by it (Gemma); 0: not */
  int64_t act;       /* ACT_* of the gated MLP */
  const float *final_norm;
  const DLayer *layers;
} DModel;

/* y[m] = w(x[m]) for M rows by the quantized kernels (`exact`: fp32 or int16 activations,
 * quant_linear_cpu.c); layer weights are always quantized here (decode_cpu.py). */
static int apply(const DWeight *w, const float *x, int64_t M, int exact, float *y) {
  if (w->kind == W_Q4)
    return q4_linear_f32(x, M, w->k, w->codes, w->scales, (int)w->half, w->bias, y, w->n,
                         exact);
  if (w->kind == W_Q8)
    return q8_linear_f32(x, M, w->k, w->codes, w->scales, (int)w->half, w->bias, y, w->n,
                         exact);
  return 1;
}

/* Row `id` of the embedding as fp32. */
static void embed_row(const DWeight *e, int64_t id, float *out) {
  if (e->kind == W_Q4)
    q4_dequant_f32(e->codes, e->scales, (int)e->half, e->k, &id, 1, out);
  else if (e->kind == W_Q8)
    q8_dequant_f32(e->codes, e->scales, (int)e->half, e->k, &id, 1, out);
  else
    memcpy(out, (const float *)e->codes + id * e->k, sizeof(float) * e->k);
}

/* out = weight * (x / sqrt(mean(x^2) + eps)), n values (out may be x). */
static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / sqrtf(ss / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
}

/* HF rotate_half rotary on one head in place: x*cos + rotate_half(x)*sin. */
static void rotate(float *x, const float *cos, const float *sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

/* torch's GELU, tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static inline float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;
  return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* h += out for M rows of n, out first normed in place where a norm is given (Gemma). */
static void add_residual(float *h, float *out, const float *norm, int64_t M, int64_t n,
                         float eps) {
  if (norm)
    for (int64_t r = 0; r < M; ++r) rms_norm(out + r * n, norm, n, eps, out + r * n);
  for (int64_t i = 0; i < M * n; ++i) h[i] += out[i];
}

typedef struct {
  float *h, *x, *qkv, *q, *attn, *gu, *act, *tmp;
} Scratch;

static int scratch_alloc(const DModel *m, int64_t M, Scratch *s) {
  const int64_t qn = m->heads * m->head_dim, kvn = m->kv_heads * m->head_dim;
  const int64_t sizes[8] = {m->hidden, m->hidden, qn + 2 * kvn, qn,
                            qn,        2 * m->intermediate, m->intermediate, m->hidden};
  int64_t total = 0;
  for (int i = 0; i < 8; ++i) total += sizes[i] * M;
  float *base = malloc(sizeof(float) * (size_t)total);
  if (!base) return 2;
  float **slots[8] = {&s->h, &s->x, &s->qkv, &s->q, &s->attn, &s->gu, &s->act, &s->tmp};
  for (int i = 0; i < 8; ++i) {
    *slots[i] = base;
    base += sizes[i] * M;
  }
  return 0;
}

/* After the qkv projection: per-head norms, rotary, q to its own buffer, k/v to the cache. */
static void qkv_to_cache(const DModel *m, const DLayer *l, int64_t M, const int64_t *positions,
                         const int64_t *slots, Scratch *s) {
  const int64_t hd = m->head_dim, qn = m->heads * hd, kvn = m->kv_heads * hd;
  const int64_t width = qn + 2 * kvn;
  for (int64_t r = 0; r < M; ++r) {
    float *row = s->qkv + r * width;
    const float *cos = l->cos + positions[r] * hd, *sin = l->sin + positions[r] * hd;
    for (int64_t h = 0; h < m->heads + m->kv_heads; ++h) {
      float *head = row + h * hd; /* q heads, then k heads */
      if (l->q_norm) rms_norm(head, h < m->heads ? l->q_norm : l->k_norm, hd, m->eps, head);
      rotate(head, cos, sin, hd);
    }
    memcpy(s->q + r * qn, row, sizeof(float) * qn);
    memcpy(l->k_cache + slots[r] * kvn, row + qn, sizeof(float) * kvn);
    memcpy(l->v_cache + slots[r] * kvn, row + qn + kvn, sizeof(float) * kvn);
  }
}

static int layer_forward(const DModel *m, const DLayer *l, int64_t M, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, Scratch *s) {
  const int64_t H = m->hidden, I = m->intermediate, hd = m->head_dim;
  int err;
  for (int64_t r = 0; r < M; ++r) rms_norm(s->h + r * H, l->input_norm, H, m->eps, s->x + r * H);
  if ((err = apply(&l->qkv, s->x, M, m->exact, s->qkv))) return err;
  qkv_to_cache(m, l, M, positions, slots, s);
  if (paged_decode_attention_f32(s->q, l->k_cache, l->v_cache, tables, table_stride, seq_lens,
                                 s->attn, M, m->heads, m->kv_heads, hd, m->block_size, m->scale,
                                 l->window))
    return 2;
  if ((err = apply(&l->o, s->attn, M, m->exact, s->tmp))) return err;
  add_residual(s->h, s->tmp, l->attn_out_norm, M, H, m->eps);
  for (int64_t r = 0; r < M; ++r) rms_norm(s->h + r * H, l->post_norm, H, m->eps, s->x + r * H);
  if ((err = apply(&l->gate_up, s->x, M, m->exact, s->gu))) return err;
  for (int64_t r = 0; r < M; ++r) {
    const float *gate = s->gu + r * 2 * I, *up = gate + I;
    float *a = s->act + r * I;
    if (m->act == ACT_GELU_TANH)
      for (int64_t i = 0; i < I; ++i) a[i] = gelu_tanh(gate[i]) * up[i];
    else
      for (int64_t i = 0; i < I; ++i) a[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
  }
  if ((err = apply(&l->down, s->act, M, m->exact, s->tmp))) return err;
  add_residual(s->h, s->tmp, l->mlp_out_norm, M, H, m->eps);
  return 0;
}

int decode_forward_f32(const DModel *m, int64_t M, const int64_t *ids, const int64_t *positions,
                       const int64_t *slots, const int32_t *tables, int64_t table_stride,
                       const int32_t *seq_lens, float *out) {
  if (M > MAX_DECODE_ROWS) return 1;
  Scratch s;
  if (scratch_alloc(m, M, &s)) return 2;
  const int64_t H = m->hidden;
  for (int64_t r = 0; r < M; ++r) embed_row(&m->embed, ids[r], s.h + r * H);
  if (m->embed_scale > 0.f)
    for (int64_t i = 0; i < M * H; ++i) s.h[i] *= m->embed_scale;
  int err = 0;
  for (int64_t i = 0; i < m->num_layers && !err; ++i)
    err = layer_forward(m, &m->layers[i], M, positions, slots, tables, table_stride, seq_lens,
                        &s);
  if (!err)
    for (int64_t r = 0; r < M; ++r) rms_norm(s.h + r * H, m->final_norm, H, m->eps, out + r * H);
  free(s.h);
  return err;
}
