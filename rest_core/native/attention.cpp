// Attention of a few query rows (a one-token step, or a verify pass over a draft tree) over a key/value cache,
// for grouped-query heads, float32, with an optional additive or boolean mask.
//
// Per layer a one-token step has 1 row per query head and a 16-node verify pass 16; against a cache of a
// thousand keys that is a few million multiply-adds.  A general attention kernel spends far more than that
// arranging the work (torch's CPU kernel took ~0.2 ms per layer of SmolLM2-135M for a one-token step).  Here:
//
// * The keys are split into one stretch per thread (flash-decoding style): every thread works on every row of
//   every head over its own keys, keeping per row the stretch's maximum score, sum of exponentials and
//   weighted values, and the stretches are merged at the end.  The load is even for one row as for sixty-four.
// * Rows (query heads sharing a key head x query positions) are the vector lanes: the queries are transposed
//   once (D x rows, the scale folded in), and a key's score for 16 (AVX-512) or 8 (AVX2) rows is a chain of
//   D multiply-adds of one broadcast key value with one vector of query values; several keys at a time keep
//   the chains independent.  No horizontal sums and no transposing of the cache.  The scores are stored
//   key-major (keys x rows), so the softmax runs across rows too.
// * The mask is added only at keys where some row's mask is not zero (a draft tree's own nodes; the prefix is
//   seen by every row), found by one scan of the mask per call.
// * Exponentials with a vector polynomial (the Cephes expf scheme, ~1 ulp); a score more than 87 below the
//   row's maximum (a masked key: the mask adds the lowest float) counts exactly zero.
// * Weighted values: a few rows' sums held in registers, one load of each value vector serving them all.
//
// A row's arithmetic depends only on its own query, mask row, the cache and the thread count, not on how many
// other rows the pass holds.  Threads come from OpenMP, the runtime torch uses.
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;
constexpr int ACC = 24;  // vector accumulators the score loop may hold (of 32 registers)
constexpr int MAX_RV = 3;  // row vectors per sweep over the keys
#else
constexpr int LANES = 8;
constexpr int ACC = 12;  // of 16 registers (AVX2)
constexpr int MAX_RV = 2;
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4), aligned(4)));
constexpr float CUTOFF = -87.0f;  // exp of anything lower counts as zero
constexpr int MAX_VR = 4;         // rows whose weighted values are summed together

inline vec splat(float x) { return vec{} + x; }

// exp(x) for x <= 0 (a score minus its row's maximum); 0 below CUTOFF.
inline vec vexp(vec x) {
  const vec low = splat(CUTOFF);
  const vec xc = x < low ? low : x;
  // n = round(x / ln 2), r = x - n ln 2 (in two parts for precision)
  const vec fn = xc * splat(1.44269504088896341f) - splat(0.5f);
  const ivec n = __builtin_convertvector(fn, ivec);  // truncation towards zero of a value <= -0.5: rounds down
  const vec nf = __builtin_convertvector(n, vec);
  vec r = xc - nf * splat(0.693359375f);
  r = r - nf * splat(-2.12194440e-4f);
  vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const ivec bits = (n + 127) << 23;  // 2^n
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const vec e = p * scale;
  return x < low ? vec{} : e;
}

struct Args {
  const float* q;  // (B, H, Q, D) by strides; D contiguous
  int64_t q_b, q_h, q_q;
  const float* k;  // (B, KVH, T, D)
  int64_t k_b, k_h, k_t;
  const float* v;
  int64_t v_b, v_h, v_t;
  const void* mask;  // (B or 1, 1, Q, T) by strides; T contiguous; float additive (kind 1) or bool (kind 2)
  int64_t m_b, m_q;
  int kind;
  const uint8_t* marked;  // (B, T): 1 where some row's mask is not "attend freely"
  float* out;             // (B, Q, H, D) contiguous
  int64_t B, H, KVH, Q, T, D;
  float scale;
};

// scores s[t][0 .. RV * LANES) of keys [t, t + TB) for RV vectors of rows (qt: D x rp, this sweep's first row)
template <int RV, int TB>
inline void score_keys(const float* qt, int64_t rp, const float* k, int64_t k_t, int64_t D, float* s) {
  vec acc[TB][RV];
  for (int i = 0; i < TB; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = vec{};
  for (int64_t d = 0; d < D; ++d) {
    vec qv[RV];
    for (int v = 0; v < RV; ++v) qv[v] = *(const vec*)(qt + d * rp + v * LANES);
    for (int i = 0; i < TB; ++i) {
      const float kd = k[i * k_t + d];
      for (int v = 0; v < RV; ++v) acc[i][v] += qv[v] * kd;
    }
  }
  for (int i = 0; i < TB; ++i)
    for (int v = 0; v < RV; ++v) *(vec*)(s + i * rp + v * LANES) = acc[i][v];
}

template <int RV>
void score_sweep(const float* qt, int64_t rp, const float* k, int64_t k_t, int64_t D, int64_t n, float* s) {
  constexpr int TB = ACC / RV < 8 ? ACC / RV : 8;
  int64_t t = 0;
  for (; t + TB <= n; t += TB) score_keys<RV, TB>(qt, rp, k + t * k_t, k_t, D, s + t * rp);
  for (; t < n; ++t) score_keys<RV, 1>(qt, rp, k + t * k_t, k_t, D, s + t * rp);
}

// o[j][:] += sum over t of p[t][j] v[t][:] for VR rows j (p: n x rp, this block's first row), D = DV vectors
template <int VR, int DV>
inline void weigh_rows(const float* p, int64_t rp, const float* v, int64_t v_t, int64_t n, float* o, int64_t D) {
  vec acc[VR][DV];
  for (int j = 0; j < VR; ++j)
    for (int c = 0; c < DV; ++c) acc[j][c] = vec{};
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v + t * v_t;
    const float* pt = p + t * rp;
    for (int c = 0; c < DV; ++c) {
      const vec x = *(const vec*)(vt + c * LANES);
      for (int j = 0; j < VR; ++j) acc[j][c] += x * pt[j];
    }
  }
  for (int j = 0; j < VR; ++j)
    for (int c = 0; c < DV; ++c) *(vec*)(o + j * D + c * LANES) = acc[j][c];
}

template <int DV>
void weigh(const float* p, int64_t rp, int64_t rows, const float* v, int64_t v_t, int64_t n, float* o, int64_t D) {
  int64_t j = 0;
  constexpr int VR = DV * MAX_VR <= ACC ? MAX_VR : (ACC / DV > 0 ? ACC / DV : 1);
  for (; j + VR <= rows; j += VR) weigh_rows<VR, DV>(p + j, rp, v, v_t, n, o + j * D, D);
  if constexpr (VR > 3) {  // the last rows in one sweep over the values where they fit
    if (rows - j == 3) {
      weigh_rows<3, DV>(p + j, rp, v, v_t, n, o + j * D, D);
      j += 3;
    } else if (rows - j == 2) {
      weigh_rows<2, DV>(p + j, rp, v, v_t, n, o + j * D, D);
      j += 2;
    }
  }
  for (; j < rows; ++j) weigh_rows<1, DV>(p + j, rp, v, v_t, n, o + j * D, D);
}

void weigh_any(const float* p, int64_t rp, int64_t rows, const float* v, int64_t v_t, int64_t n, float* o,
               int64_t D) {
  switch (D / LANES) {
    case 1: weigh<1>(p, rp, rows, v, v_t, n, o, D); break;
    case 2: weigh<2>(p, rp, rows, v, v_t, n, o, D); break;
    case 4: weigh<4>(p, rp, rows, v, v_t, n, o, D); break;
    case 5: weigh<5>(p, rp, rows, v, v_t, n, o, D); break;
    case 6: weigh<6>(p, rp, rows, v, v_t, n, o, D); break;
    case 8: weigh<8>(p, rp, rows, v, v_t, n, o, D); break;
    case 16: weigh<16>(p, rp, rows, v, v_t, n, o, D); break;
    default: break;  // refused before any work
  }
}

bool head_size_taken(int64_t D) {
  if (D % LANES) return false;
  const int64_t dv = D / LANES;
  return dv == 1 || dv == 2 || dv == 4 || dv == 5 || dv == 6 || dv == 8 || dv == 16;
}

// One key head of one batch row over keys [t0, t1): per row (head-in-group x query) its maximum, sum of
// exponentials and unnormalised weighted values (rows x D) into m, l, o.
void stretch(const Args& a, int64_t b, int64_t g, int64_t t0, int64_t t1, float* m, float* l, float* o) {
  const int64_t groups = a.H / a.KVH, rows = groups * a.Q, D = a.D, n = t1 - t0;
  const int64_t rp = (rows + LANES - 1) / LANES * LANES;  // rows padded to whole vectors
  static thread_local std::vector<float> buf;
  const std::size_t need = (std::size_t)(D * rp + n * rp);
  if (buf.size() < need) buf.resize(need);
  float* qt = buf.data();  // D x rp: the queries transposed, scaled, zero past the last row
  float* s = qt + D * rp;  // n x rp: scores, then exponentials
  for (int64_t j = 0; j < rp; ++j) {
    if (j < rows) {
      const float* src = a.q + b * a.q_b + (g * groups + j / a.Q) * a.q_h + (j % a.Q) * a.q_q;
      for (int64_t d = 0; d < D; ++d) qt[d * rp + j] = src[d] * a.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * rp + j] = 0.0f;
    }
  }
  const float* K = a.k + b * a.k_b + g * a.k_h + t0 * a.k_t;
  for (int64_t v0 = 0; v0 < rp / LANES; v0 += MAX_RV) {
    const int64_t rv = rp / LANES - v0 < MAX_RV ? rp / LANES - v0 : MAX_RV;
    const float* q0 = qt + v0 * LANES;
    float* s0 = s + v0 * LANES;
    if (rv == 1) score_sweep<1>(q0, rp, K, a.k_t, D, n, s0);
    else if (rv == 2) score_sweep<2>(q0, rp, K, a.k_t, D, n, s0);
    else score_sweep<MAX_RV>(q0, rp, K, a.k_t, D, n, s0);  // rv == 3 (AVX-512 only)
  }
  // the mask, at the keys where it is not zero for every row
  if (a.kind) {
    const uint8_t* marked = a.marked + b * a.T + t0;
    for (int64_t t = 0; t < n; ++t) {
      if (!marked[t]) continue;
      float* st = s + t * rp;
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t at = b * a.m_b + (j % a.Q) * a.m_q + t0 + t;
        if (a.kind == 1) st[j] += ((const float*)a.mask)[at];
        else if (!((const bool*)a.mask)[at]) st[j] = -INFINITY;
      }
    }
  }
  // softmax across the keys, rows side by side
  for (int64_t v = 0; v < rp / LANES; ++v) {
    vec mx = splat(-INFINITY), sum = vec{};
    for (int64_t t = 0; t < n; ++t) {
      const vec x = *(const vec*)(s + t * rp + v * LANES);
      mx = x > mx ? x : mx;
    }
    const vec finite = mx == splat(-INFINITY) ? vec{} : mx;  // a row with every key masked: weights 0, sum 0
    for (int64_t t = 0; t < n; ++t) {
      vec* x = (vec*)(s + t * rp + v * LANES);
      const vec e = vexp(*x - finite);
      *x = e;
      sum += e;
    }
    for (int i = 0; i < LANES && v * LANES + i < rows; ++i) {
      m[v * LANES + i] = mx[i];
      l[v * LANES + i] = sum[i];
    }
  }
  weigh_any(s, rp, rows, a.v + b * a.v_b + g * a.v_h + t0 * a.v_t, a.v_t, n, o, D);
}

}  // namespace

extern "C" {

// Returns 0, or 1 when the shapes are outside what the kernel takes or out (out_len floats) cannot hold
// B x Q x H x D (nothing is written then; the caller uses another kernel).
// Strides in floats (bool masks: in elements): q (b, h, q), k and v (b, h, t), mask (b, q; b = 0 when shared).
int rest_lab_attention(const float* q, const int64_t* q_strides, const float* k, const int64_t* k_strides,
                       const float* v, const int64_t* v_strides, const void* mask, const int64_t* m_strides,
                       int kind, float* out, int64_t out_len, int64_t B, int64_t H, int64_t KVH, int64_t Q,
                       int64_t T, int64_t D, float scale, int threads) {
  if (!head_size_taken(D) || KVH <= 0 || H % KVH || T <= 0 || Q <= 0 || B <= 0 || kind < 0 || kind > 2) return 1;
  if (out_len < B * Q * H * D) return 1;
  if (threads < 1) threads = 1;
  std::vector<uint8_t> marked(kind ? (std::size_t)(B * T) : 0, 0);
  for (int64_t b = 0; kind && b < B; ++b) {
    uint8_t* mk = marked.data() + b * T;
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t row = b * m_strides[0] + i * m_strides[1];
      if (kind == 1) {
        const float* mr = (const float*)mask + row;
        for (int64_t t = 0; t < T; ++t) mk[t] |= mr[t] != 0.0f;
      } else {
        const bool* mr = (const bool*)mask + row;
        for (int64_t t = 0; t < T; ++t) mk[t] |= !mr[t];
      }
    }
  }
  Args a{q, q_strides[0], q_strides[1], q_strides[2], k, k_strides[0], k_strides[1], k_strides[2],
         v, v_strides[0], v_strides[1], v_strides[2], mask, m_strides[0], m_strides[1], kind, marked.data(), out,
         B, H, KVH, Q, T, D, scale};
  // stretches of at least 64 keys, one per thread
  int64_t parts = threads;
  while (parts > 1 && T / parts < 64) --parts;
  const int64_t per = (T + parts - 1) / parts;
  parts = (T + per - 1) / per;
  const int64_t rows = (H / KVH) * Q;
  const int64_t items = B * KVH * parts;
  std::vector<float> m((std::size_t)(items * rows)), l(m.size()), o(m.size() * (std::size_t)D);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t p = it % parts, g = (it / parts) % KVH, b = it / (parts * KVH);
    const int64_t t0 = p * per, t1 = t0 + per < T ? t0 + per : T;
    const std::size_t at = (std::size_t)(it * rows);
    stretch(a, b, g, t0, t1, m.data() + at, l.data() + at, o.data() + at * D);
  }
  // merge the stretches: out = sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p
  const int64_t groups = H / KVH;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g)
      for (int64_t r = 0; r < rows; ++r) {
        const std::size_t first = (std::size_t)((b * KVH + g) * parts * rows + r);
        float top = -INFINITY;
        for (int64_t p = 0; p < parts; ++p) top = m[first + p * rows] > top ? m[first + p * rows] : top;
        float* dst = out + ((b * Q + r % Q) * H + g * groups + r / Q) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = 0.0f;
        float total = 0.0f;
        for (int64_t p = 0; p < parts; ++p) {
          const std::size_t at = first + p * rows;
          if (l[at] == 0.0f) continue;
          const float w = parts == 1 ? 1.0f : std::exp(m[at] - top);
          total += w * l[at];
          const float* src = o.data() + at * D;
          for (int64_t d = 0; d < D; ++d) dst[d] += w * src[d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a row with every key masked gets zeros
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
  return 0;
}

int rest_lab_attention_lanes(void) { return LANES; }

}  // extern "C"
