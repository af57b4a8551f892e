// The k largest values of each row of a float32 matrix (logits: a few rows of a whole vocabulary), as ids
// largest first; of equal values the lower id comes first, so rank 0 is the argmax torch and numpy give.
//
// One pass over each row: the row is read in blocks of 16 vectors whose maximum is compared with the k-th
// largest value so far, and only a block that holds a larger value is looked into.  After the first few
// thousand values almost no block does, so the pass runs at the speed of reading the row.
//
// Right after a forward pass the logits are not in the reading core's cache: the output layer wrote them on
// every thread (REST Lab's blocked kernel gives each thread its own stretch of the vocabulary, the columns
// split evenly, in order).  So a row is read in as many stretches as there are threads, thread t taking
// stretch t of every row -- the part its own core wrote, where that kernel ran -- and the stretches' top
// lists are merged (an equal value keeps the lower id first, as one pass would).  Timed inside chat decodes on
// a 2-vCPU Xeon, a one-row top-k took 0.16 ms right after the pass and 0.03 ms when read again; read in
// stretches, 9-16 rows took 0.34 ms instead of 0.49, while one row (whose output layer runs the default
// kernel there) stayed at 0.16.  Threads come from OpenMP, the runtime torch uses, whose threads are still
// awake after the pass.  Returns 1 when a row holds a NaN (the caller then uses torch's own top-k, which has
// its own rule for NaN).
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int ivec __attribute__((vector_size(LANES * 4)));
constexpr int VB = 16;             // vectors per block
constexpr int BLOCK = VB * LANES;  // floats per block
constexpr int MAX_K = 64;

// Put value v of id into the sorted top list (largest first, `n` entries, room for one more when n < k).
// An equal value already there stays ahead: it has the lower id.
inline void insert(float v, int64_t id, float* vals, int64_t* ids, int n) {
  int j = n;
  while (j > 0 && vals[j - 1] < v) {
    vals[j] = vals[j - 1];
    ids[j] = ids[j - 1];
    --j;
  }
  vals[j] = v;
  ids[j] = id;
}

// The top k of x[0 .. V) into vals / out (ids offset by `first`), largest first; 1 on a NaN.
int row_top(const float* x, int64_t V, int k, int64_t first, float* top_vals, int64_t* out) {
  float vals[MAX_K + 1];
  int64_t ids[MAX_K + 1];
  int n = 0;
  int64_t i = 0;
  for (; i < V && n < k; ++i) {  // the first k values, sorted
    if (x[i] != x[i]) return 1;
    insert(x[i], i, vals, ids, n++);
  }
  // scalar up to a vector boundary, then whole blocks, then the tail
  for (; i < V && (i % LANES); ++i) {
    if (x[i] != x[i]) return 1;
    if (x[i] > vals[k - 1]) insert(x[i], i, vals, ids, k - 1);
  }
  ivec nan = {};
  for (; i + BLOCK <= V; i += BLOCK) {
    vec m = *(const vec*)(x + i);
    nan |= (m != m);
    for (int v = 1; v < VB; ++v) {
      const vec w = *(const vec*)(x + i + v * LANES);
      nan |= (w != w);
      m = w > m ? w : m;
    }
    float top = m[0];
    for (int l = 1; l < LANES; ++l) top = m[l] > top ? m[l] : top;
    if (!(top > vals[k - 1])) continue;
    for (int v = 0; v < VB; ++v) {  // the block holds a new top value: find the vectors that do
      const float* p = x + i + v * LANES;
      const ivec hit = *(const vec*)p > vals[k - 1];
      int any = 0;
      for (int l = 0; l < LANES; ++l) any |= hit[l];
      if (!any) continue;
      for (int l = 0; l < LANES; ++l)
        if (p[l] > vals[k - 1]) insert(p[l], i + v * LANES + l, vals, ids, k - 1);
    }
  }
  for (int l = 0; l < LANES; ++l)
    if (nan[l]) return 1;
  for (; i < V; ++i) {
    if (x[i] != x[i]) return 1;
    if (x[i] > vals[k - 1]) insert(x[i], i, vals, ids, k - 1);
  }
  for (int j = 0; j < k; ++j) {
    out[j] = ids[j] + first;
    top_vals[j] = vals[j];
  }
  return 0;
}

constexpr int64_t MIN_STRETCH = 4096;  // values per stretch at least: shorter rows are read in fewer stretches

}  // namespace

extern "C" {

// out (rows x k, int64) = each row's k largest ids of x (rows x V, float32, row-major); 1 <= k <= min(V, 64);
// up to `threads` stretches per row, read in parallel.  x_len and out_len are the buffers' sizes in elements.
// Returns 2, with nothing read or written, when a buffer is too small or k is out of range; 1 when some row
// holds a NaN (out is then incomplete); else 0.
int rest_lab_row_top_k(const float* x, int64_t x_len, int64_t rows, int64_t V, int k, int64_t* out, int64_t out_len,
                       int threads) {
  if (k < 1 || k > MAX_K || k > V || rows < 0 || x_len < rows * V || out_len < rows * k) return 2;
  int64_t parts = threads > 1 ? threads : 1;
  while (parts > 1 && V / parts < (MIN_STRETCH > k ? MIN_STRETCH : k)) --parts;
  const int64_t per = (V + parts - 1) / parts;  // stretch p: [p * per, min(V, (p + 1) * per)), each >= k long
  std::vector<float> vals((std::size_t)(rows * parts * k));
  std::vector<int64_t> ids(vals.size());
  int nan = 0;
  // item i: stretch i / rows of row i % rows, so with a static schedule thread t reads stretch t of every row
#pragma omp parallel for schedule(static) num_threads((int)parts) reduction(| : nan)
  for (int64_t i = 0; i < rows * parts; ++i) {
    const int64_t r = i % rows, p = i / rows, first = p * per, last = first + per < V ? first + per : V;
    nan |= row_top(x + r * V + first, last - first, k, first, vals.data() + i * k, ids.data() + i * k);
  }
  if (nan) return 1;
  std::vector<int> head((std::size_t)parts);
  for (int64_t r = 0; r < rows; ++r) {  // merge the stretches: larger value first, on a tie the lower stretch
    for (auto& h : head) h = 0;
    for (int j = 0; j < k; ++j) {
      int64_t best = 0;
      for (int64_t p = 1; p < parts; ++p)
        if (vals[(p * rows + r) * k + head[p]] > vals[(best * rows + r) * k + head[best]]) best = p;
      out[r * k + j] = ids[(best * rows + r) * k + head[best]++];
    }
  }
  return 0;
}

}  // extern "C"
