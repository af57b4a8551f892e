// y = x W^T + b for a few rows of x, with W stored once in column panels: the weight is streamed from
// memory once per call whatever the row count, and every weight value loaded serves every row.
//
// Layout: W (N x K, row-major) is packed into ceil(N / 16) panels of K x 16 floats (panel b holds output
// columns 16b .. 16b+15, zero past N), so a panel is read front to back, one row of 16 floats per k.
// The micro-kernel keeps a block of R rows x 16 columns of sums in registers and broadcasts one x value per
// row and k.  Two block heights, two entry points; which one a layer uses at which row count is measured at
// run time (rest_core.kernels), since the better one differs between CPUs:
//  * rest_lab_panel_linear: blocks of up to SHORT rows, x read where it is (a general-purpose register per
//    row holds each row's address).  SHORT follows the register file the compiler targets (-march=native):
//    8 with AVX-512 (a panel row is one 16-float vector), 6 with AVX2 (16 registers of 8 floats: 12 of them
//    for 6 rows); more rows take further sweeps over a panel that is then in cache.
//  * rest_lab_panel_linear_tall (AVX-512 only): blocks of 16 rows, 16 of the 32 vector registers, reading x
//    from a copy transposed once per call (a step's 16 values side by side at fixed offsets from one pointer;
//    read in place, 16 row addresses do not fit the 16 general-purpose registers and were reloaded from the
//    stack at every step: the output layer over 16 rows took 1.17-1.26x as long on a Xeon).  On a Xeon the
//    tall blocks made a 16-token pass 1.39x -> 1.24x a one-token pass; on a Zen 4 two in-place sweeps of 8
//    were faster at 16 and 24 rows (the transposition runs on one thread before the parallel part).
// Plain GCC/Clang vector types: the compiler maps them to AVX2, AVX-512 or NEON; threads come from OpenMP
// (the same runtime torch uses, so no second thread pool competes for the cores).
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;  // floats per vector register
constexpr int SHORT = 8;   // rows per block read in place
constexpr int TALL = 16;   // rows per block read transposed (16 of the 32 vector registers)
#else
constexpr int LANES = 8;
constexpr int SHORT = 6;   // 12 of 16 registers (AVX2); NEON has 32 registers of 4 floats, the same 6 fit
constexpr int TALL = 0;    // none: the short blocks serve every row count
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
constexpr int64_t NB = 16;           // output columns per panel
constexpr int VPR = NB / LANES;      // vectors per panel row
constexpr int64_t AHEAD = 4096;      // floats of panel prefetched ahead (16 KB), at every row count: on a Xeon
                                     // that beat leaving 1-5 rows to the hardware prefetcher
constexpr int LOCALITY = 1;          // ... into L2 only (prefetcht2 on x86), not L1: the panel is read once, and
                                     // pulled into L1 16 KB ahead it pushed the block's x rows (18 KB for 8
                                     // rows) out of a 32 KB L1.  On a Zen 4 that made 6-12 rows cost what one
                                     // row costs inside a verify pass (8 rows: 1.4x the time of one row with
                                     // prefetches into L1) and 16 rows 11-17% less; 1-4 rows unchanged

template <int R>
inline __attribute__((always_inline)) void micro(const float* x, const float* xt, int64_t K, const float* panel,
                                                 const float* bias, float* out, int64_t N, int64_t cols) {
  // x: this block's R rows (R x K); xt: the same transposed, K x R (row j of step k at xt[k * R + j]), where
  // R > SHORT (a tall block): a step's x values side by side at fixed offsets from one pointer
  vec b[VPR];
  for (int v = 0; v < VPR; ++v) b[v] = *(const vec*)(bias + v * LANES);
  vec acc[R][VPR];
  for (int j = 0; j < R; ++j)
    for (int v = 0; v < VPR; ++v) acc[j][v] = b[v];
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * NB;
    __builtin_prefetch(p + AHEAD, 0, LOCALITY);
    vec w[VPR];
    for (int v = 0; v < VPR; ++v) w[v] = *(const vec*)(p + v * LANES);
    for (int j = 0; j < R; ++j) {
      const float s = R > SHORT ? xt[k * R + j] : x[j * K + k];  // broadcast by the vector-scalar product
      for (int v = 0; v < VPR; ++v) acc[j][v] += w[v] * s;
    }
  }
  if (cols == NB) {
    for (int j = 0; j < R; ++j)
      for (int v = 0; v < VPR; ++v) *(vec*)(out + j * N + v * LANES) = acc[j][v];
  } else {  // the last panel of an N that is not a multiple of 16
    for (int j = 0; j < R; ++j)
      for (int64_t c = 0; c < cols; ++c) out[j * N + c] = acc[j][c / LANES][c % LANES];
  }
}

// The last M % B rows of a call with blocks of B: the micro-kernel for exactly that many rows (R counts down
// to 1).
template <int R>
inline void tail(int rows, const float* x, const float* xt, int64_t K, const float* panel, const float* bias,
                 float* out, int64_t N, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R)
      micro<R>(x, xt, K, panel, bias, out, N, cols);
    else
      tail<R - 1>(rows, x, xt, K, panel, bias, out, N, cols);
  }
}

// Panel b for every row, in blocks of B rows; xt: x's blocks of more than SHORT rows transposed (see
// `transpose_blocks`).
template <int B>
void panel_rows(const float* x, const float* xt, const float* panel, const float* bias, float* out, int64_t M,
                int64_t K, int64_t N, int64_t b) {
  const int64_t cols = N - b * NB < NB ? N - b * NB : NB;
  int64_t m = 0;
  for (; m + B <= M; m += B) micro<B>(x + m * K, xt + m * K, K, panel, bias, out + m * N + b * NB, N, cols);
  if (m < M) tail<B - 1>((int)(M - m), x + m * K, xt + m * K, K, panel, bias, out + m * N + b * NB, N, cols);
}

// x (M x K) in blocks of B rows (the last one holding M % B rows, if any): each block of more than SHORT rows
// transposed to K x R floats at the same place as in x; the others are read from x and left out.
template <int B>
void transpose_blocks(const float* x, float* xt, int64_t M, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += B) {
    const int64_t R = M - m0 < B ? M - m0 : B;
    if (R <= SHORT) continue;
    const float* src = x + m0 * K;
    float* blk = xt + m0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < R; ++j) blk[k * R + j] = src[j * K + k];
  }
}

template <int B>
void linear(const float* x, const float* panels, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
            int threads) {
  const int64_t count = (N + NB - 1) / NB;
  const float* xt = x;  // nothing to transpose unless a block holds more than SHORT rows
  if (B > SHORT && M > SHORT) {  // one buffer per calling thread (torch's) serves every call
    static thread_local std::vector<float> buffer;
    if (buffer.size() < (std::size_t)(M * K)) buffer.resize((std::size_t)(M * K));
    transpose_blocks<B>(x, buffer.data(), M, K);
    xt = buffer.data();
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < count; ++b) panel_rows<B>(x, xt, panels + b * K * NB, bias + b * NB, out, M, K, N, b);
}

}  // namespace

extern "C" {

// Panels of W (N x K, row-major, float32) into `panels` (ceil(N / 16) x K x 16 floats, zero-padded).  The
// lengths are the buffers' sizes in floats; returns 1, with nothing written, when either is too small.
int rest_lab_pack_panels(const float* w, int64_t w_len, float* panels, int64_t panels_len, int64_t K, int64_t N,
                         int threads) {
  const int64_t count = (N + NB - 1) / NB;
  if (K < 0 || N < 0 || w_len < N * K || panels_len < count * K * NB) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < count; ++b) {
    float* p = panels + b * K * NB;
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = b * NB + c;
      for (int64_t k = 0; k < K; ++k) p[k * NB + c] = n < N ? w[n * K + k] : 0.0f;
    }
  }
  return 0;
}

// Whether the buffers hold what an M x K by packed (N x K) product reads and writes (lengths in floats).
static bool fits(int64_t x_len, int64_t panels_len, int64_t bias_len, int64_t out_len, int64_t M, int64_t K,
                 int64_t N) {
  const int64_t padded = (N + NB - 1) / NB * NB;
  return M >= 0 && K >= 0 && N >= 0 && x_len >= M * K && panels_len >= padded * K && bias_len >= padded &&
         out_len >= M * N;
}

// out (M x N) = x (M x K) times the packed W, plus bias (ceil(N / 16) * 16 floats, zero-padded: never null):
// blocks of up to SHORT rows, x read in place.  The lengths are the buffers' sizes in floats; returns 1, with
// nothing read or written, when one is too small for M, K and N, else 0.
int rest_lab_panel_linear(const float* x, int64_t x_len, const float* panels, int64_t panels_len, const float* bias,
                          int64_t bias_len, float* out, int64_t out_len, int64_t M, int64_t K, int64_t N,
                          int threads) {
  if (!fits(x_len, panels_len, bias_len, out_len, M, K, N)) return 1;
  linear<SHORT>(x, panels, bias, out, M, K, N, threads);
  return 0;
}

// The same product in blocks of TALL rows read from a transposed copy of x; where this build has no tall
// blocks (rest_lab_tall_rows() == 0) the same as rest_lab_panel_linear.
int rest_lab_panel_linear_tall(const float* x, int64_t x_len, const float* panels, int64_t panels_len,
                               const float* bias, int64_t bias_len, float* out, int64_t out_len, int64_t M, int64_t K,
                               int64_t N, int threads) {
  if (!fits(x_len, panels_len, bias_len, out_len, M, K, N)) return 1;
  linear<(TALL > SHORT ? TALL : SHORT)>(x, panels, bias, out, M, K, N, threads);
  return 0;
}

int rest_lab_panel_width(void) { return (int)NB; }

// The calling convention of the entry points above: 2 since they take every buffer's length.
int rest_lab_linear_abi(void) { return 2; }

// Rows of sums the micro-kernel holds in registers on the machine this library was built for: per block read
// in place, and per tall block (0: none).
int rest_lab_register_rows(void) { return SHORT; }
int rest_lab_tall_rows(void) { return TALL; }

}  // extern "C"
