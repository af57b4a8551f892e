// y = x W^T + b for a few rows of x, with W stored once in column panels: the weight is streamed from
// memory once per call whatever the row count, and every weight value loaded serves every row.
//
// Layout: W (N x K, row-major) is packed into ceil(N / 16) panels of K x 16 floats (panel b holds output
// columns 16b .. 16b+15, zero past N), so a panel is read front to back and each k gives two 8-float
// vectors.  The micro-kernel keeps up to 6 rows x 16 columns of sums in registers (12 vectors) and
// broadcasts one x value per row and k.  Plain GCC/Clang vector types: the compiler maps them to AVX2,
// AVX-512 or NEON for the machine it is built on (-march=native); threads come from OpenMP (the same
// runtime torch uses, so no second thread pool competes for the cores).
#include <cstdint>

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));
constexpr int64_t NB = 16;       // output columns per panel
constexpr int64_t AHEAD = 4096;  // floats of panel prefetched ahead when several rows make the loop compute-bound

template <int MR, bool PREFETCH>
inline __attribute__((always_inline)) void micro(const float* x, int64_t K, const float* panel, const float* bias,
                                                 float* out, int64_t N, int64_t cols) {
  // v8 is declared with 4-byte alignment, so these loads and stores need no aligned address
  const v8 b0 = *(const v8*)bias, b1 = *(const v8*)(bias + 8);
  v8 acc[MR][2];
  for (int j = 0; j < MR; ++j) { acc[j][0] = b0; acc[j][1] = b1; }
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * NB;
    if (PREFETCH) __builtin_prefetch(p + AHEAD, 0, 3);
    const v8 w0 = *(const v8*)p, w1 = *(const v8*)(p + 8);
    for (int j = 0; j < MR; ++j) {
      const float s = x[j * K + k];
      const v8 xv = {s, s, s, s, s, s, s, s};
      acc[j][0] += xv * w0;
      acc[j][1] += xv * w1;
    }
  }
  if (cols == NB) {
    for (int j = 0; j < MR; ++j) {
      *(v8*)(out + j * N) = acc[j][0];
      *(v8*)(out + j * N + 8) = acc[j][1];
    }
  } else {  // the last panel of an N that is not a multiple of 16
    for (int j = 0; j < MR; ++j)
      for (int64_t c = 0; c < cols; ++c) out[j * N + c] = acc[j][c / 8][c % 8];
  }
}

template <bool PREFETCH>
void panel_rows(const float* x, const float* panel, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
                int64_t b) {
  const int64_t cols = N - b * NB < NB ? N - b * NB : NB;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) micro<6, PREFETCH>(x + m * K, K, panel, bias, out + m * N + b * NB, N, cols);
  const float* xm = x + m * K;
  float* om = out + m * N + b * NB;
  switch (M - m) {
    case 5: micro<5, PREFETCH>(xm, K, panel, bias, om, N, cols); break;
    case 4: micro<4, PREFETCH>(xm, K, panel, bias, om, N, cols); break;
    case 3: micro<3, PREFETCH>(xm, K, panel, bias, om, N, cols); break;
    case 2: micro<2, PREFETCH>(xm, K, panel, bias, om, N, cols); break;
    case 1: micro<1, PREFETCH>(xm, K, panel, bias, om, N, cols); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// Panels of W (N x K, row-major, float32) into `panels` (ceil(N / 16) x K x 16 floats, zero-padded).
void rest_lab_pack_panels(const float* w, float* panels, int64_t K, int64_t N, int threads) {
  const int64_t count = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < count; ++b) {
    float* p = panels + b * K * NB;
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = b * NB + c;
      for (int64_t k = 0; k < K; ++k) p[k * NB + c] = n < N ? w[n * K + k] : 0.0f;
    }
  }
}

// out (M x N) = x (M x K) times the packed W, plus bias (ceil(N / 16) * 16 floats, zero-padded: never null).
void rest_lab_panel_linear(const float* x, const float* panels, const float* bias, float* out, int64_t M, int64_t K,
                           int64_t N, int threads) {
  const int64_t count = (N + NB - 1) / NB;
  const bool prefetch = M >= 6;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < count; ++b) {
    if (prefetch)
      panel_rows<true>(x, panels + b * K * NB, bias + b * NB, out, M, K, N, b);
    else
      panel_rows<false>(x, panels + b * K * NB, bias + b * NB, out, M, K, N, b);
  }
}

int rest_lab_panel_width(void) { return (int)NB; }

}  // extern "C"
