// MatMulNBits' CompInt8 arithmetic (accuracy_level 4, block 32, 4 bits, no zero-point input = 8): the activations
// are quantized to int8 per block of 32 (scale amax / 127, round half to even), each block's dot product is an
// integer (two AVX512-VNNI dot products per 128 weights, one for the low nibbles, one for the high), blocks are
// summed in fp32 per 16-lane accumulator and reduced once per output. Faster than MLAS at one row by its memory
// side (the weights are streamed with a software prefetch, so a step whose weights sit in DRAM reads them at the
// memory's speed: scripts/experiments/q4_gemv.py), at more rows by its register tile (4 columns x 3 rows).
#include "q4Kernel.h"

// GCC 12 flags its own _mm512_undefined_* placeholders inside the AVX512 intrinsics as maybe-uninitialized
// (and, inlined into a template, as uninitialized) once they are inlined here (a known false positive); nothing of
// ours is.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

namespace df2q4 {
namespace {

constexpr int kPrefetch = 8192;  // bytes ahead of the weight load (the experiment's best of 1-32 KiB)
// The register tile: 12 accumulators, 4 x 3 decoded weight registers and one row's 4 activation loads fit the 32
// zmm registers (4 x 4 spills and 2 x 6 or 8 x 2 reuse less; measured in docs/results/q4_gemv/).
constexpr int kTileCols = 4;
constexpr int kTileRows = 3;

// One row's activations: per chunk of 128 weights (4 blocks), the int8 values the low / high nibbles multiply,
// -8 x each lane's activations (the zero point) and each lane's block scale.
struct Chunk {
  int8_t lo[64];
  int8_t hi[64];
  int32_t ncorr[16];
  float scale[16];
};
static_assert(sizeof(Chunk) == 256, "one chunk is four cache lines");

int chunks(int K) { return (K + 127) / 128; }

}  // namespace

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

size_t scratchBytes(int M, int K) { return static_cast<size_t>(M) * chunks(K) * sizeof(Chunk) + 64; }

static Chunk* aligned(const void* scratch) {
  auto p = reinterpret_cast<uintptr_t>(scratch);
  return reinterpret_cast<Chunk*>((p + 63) & ~static_cast<uintptr_t>(63));
}

#define DF2_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Rows [m0, m1): per block of 32, amax over |x| (NaNs ignored, as fmax would), x * (127 / amax) rounded half to
// even, the even elements to `lo`, the odd ones to `hi` (the order of the packed nibbles), -8 x each 8 elements'
// sum to `ncorr`. The same values a scalar loop with nearbyint gives; 16 lanes at a time.
DF2_AVX512 void prepare(int m0, int m1, int K, const float* A, void* scratch) {
  const int C = chunks(K), nb = K / 32;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i pairs = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
  Chunk* out = aligned(scratch);
  for (int m = m0; m < m1; ++m) {
    Chunk* row = out + static_cast<size_t>(m) * C;
    if (nb % 4) std::memset(static_cast<void*>(row + C - 1), 0, sizeof(Chunk));  // the part-filled last chunk
    for (int b = 0; b < nb; ++b) {
      const float* x = A + static_cast<size_t>(m) * K + 32 * b;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      // max(|x|, acc) returns acc where |x| is NaN
      const __m512 ax = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
      const float amax = _mm512_reduce_max_ps(ax);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));  // MXCSR's round-to-nearest-even
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      const __m512i lo = _mm512_permutex2var_epi32(q0, even, q1), hi = _mm512_permutex2var_epi32(q0, odd, q1);
      Chunk& c = row[b / 4];
      const int jb = (b % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c.lo + jb), _mm512_cvtepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c.hi + jb), _mm512_cvtepi32_epi8(hi));
      // lane l of this block's four: -8 x (lo + hi) over i = 4l .. 4l+3; integers, so any order is exact
      __m512i sum = _mm512_add_epi32(lo, hi);                       // [16]: pairs
      sum = _mm512_permutexvar_epi32(pairs, sum);                    // even pairs then odd pairs
      __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));  // [8]
      s8 = _mm256_add_epi32(s8, _mm256_srli_epi64(s8, 32));          // lanes 0, 2, 4, 6: the sums of 4
      alignas(32) int32_t t[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t), s8);
      for (int l = 0; l < 4; ++l) {
        c.ncorr[(jb / 4) + l] = -8 * t[2 * l];
        c.scale[(b % 4) * 4 + l] = amax / 127.f;
      }
    }
  }
}


namespace {

// One output's block sums: what every tile below does per (row, column, chunk), in this order, so that tiles of
// any size (and so any row count) give the same bits.
DF2_AVX512 inline __m512 accumulate(__m512 acc, const Chunk& a, __m512i wlo, __m512i whi, __m512 wsl) {
  __m512i d = _mm512_load_si512(a.ncorr);
  d = _mm512_dpbusd_epi32(d, wlo, _mm512_load_si512(a.lo));
  d = _mm512_dpbusd_epi32(d, whi, _mm512_load_si512(a.hi));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wsl, _mm512_load_ps(a.scale)), acc);
}

struct Weights {  // one column's chunk c, decoded: low / high nibbles and the four block scales per lane
  __m512i lo, hi;
  __m512 scale;
};

struct Shape {
  int C, nb, rb, tail;
  __mmask64 bm;
  __mmask8 sm;
  explicit Shape(int K)
      : C(chunks(K)), nb(K / 32), rb(K / 2), tail((K % 128) / 32),
        bm(tail ? ((static_cast<__mmask64>(1) << (16 * tail)) - 1) : ~static_cast<__mmask64>(0)),
        sm(tail ? static_cast<__mmask8>((1 << tail) - 1) : static_cast<__mmask8>(0xF)) {}
};

DF2_AVX512 inline Weights decode(const Shape& sh, const uint8_t* b, const float* s, int c) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const bool part = (c == sh.C - 1) && sh.tail;
  const __m512i w = part ? _mm512_maskz_loadu_epi8(sh.bm, b + 64 * c) : _mm512_loadu_si512(b + 64 * c);
  const __m128 ws = part ? _mm_maskz_loadu_ps(sh.sm, s + 4 * c) : _mm_loadu_ps(s + 4 * c);
  return {_mm512_and_si512(w, lo4), _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4),
          _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(ws))};
}

// A tile of NT columns x RG rows: its NT decoded weight chunks and RG x NT accumulators stay in registers, so a
// weight chunk is loaded once per RG rows and an activation chunk once per NT columns; at one row (a decode step)
// the NT columns are NT independent accumulation chains. The first row group prefetches the weights kPrefetch
// bytes ahead: a decode step's weights come from DRAM, and this streams them.
template <int NT, int RG>
DF2_AVX512 void tile(const Shape& sh, int m0, int N, int n, const uint8_t* B, const float* S, const Chunk* act,
                     float* Y) {
  __m512 acc[RG][NT];
  for (int j = 0; j < RG; ++j)
    for (int i = 0; i < NT; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int c = 0; c < sh.C; ++c) {
    Weights w[NT];
    if (m0 == 0) {
      // The tile's NT weight rows, and their scales, are contiguous: prefetched as one stream each, in the order
      // they are read (a prefetch per column row, 8 KiB ahead of each, left a 1-2-row call at 0.7-0.9x
      // MatMulNBits on rows of K >= 1536). The scales are 1/8 of the weights' bytes: 1/8 of the distance ahead.
      const char* bt = reinterpret_cast<const char*>(B + static_cast<size_t>(n) * sh.rb) + kPrefetch;
      for (int i = 0; i < NT; ++i) _mm_prefetch(bt + 64 * (c * NT + i), _MM_HINT_T0);
      const char* st = reinterpret_cast<const char*>(S + static_cast<size_t>(n) * sh.nb) + kPrefetch / 8;
      if ((16 * NT * c) % 64 == 0) _mm_prefetch(st + 16 * NT * c, _MM_HINT_T0);
    }
    for (int i = 0; i < NT; ++i)
      w[i] = decode(sh, B + static_cast<size_t>(n + i) * sh.rb, S + static_cast<size_t>(n + i) * sh.nb, c);
    for (int j = 0; j < RG; ++j) {
      const Chunk& a = act[static_cast<size_t>(m0 + j) * sh.C + c];
      for (int i = 0; i < NT; ++i) acc[j][i] = accumulate(acc[j][i], a, w[i].lo, w[i].hi, w[i].scale);
    }
  }
  for (int j = 0; j < RG; ++j)
    for (int i = 0; i < NT; ++i) Y[static_cast<size_t>(m0 + j) * N + n + i] = _mm512_reduce_add_ps(acc[j][i]);
}

template <int NT>
DF2_AVX512 void columns(const Shape& sh, int M, int N, int n, const uint8_t* B, const float* S, const Chunk* act,
                        float* Y) {
  int m0 = 0;
  for (; m0 + kTileRows <= M; m0 += kTileRows) tile<NT, kTileRows>(sh, m0, N, n, B, S, act, Y);
  if (M - m0 == 2) tile<NT, 2>(sh, m0, N, n, B, S, act, Y);
  if (M - m0 == 1) tile<NT, 1>(sh, m0, N, n, B, S, act, Y);
}

}  // namespace

void rows(int M, int K, int N, int n0, int n1, const uint8_t* B, const float* S, const void* scratch, float* Y) {
  const Shape sh(K);
  const Chunk* act = aligned(scratch);
  int n = n0;
  for (; n + kTileCols <= n1; n += kTileCols) columns<kTileCols>(sh, M, N, n, B, S, act, Y);
  for (; n < n1; ++n) columns<1>(sh, M, N, n, B, S, act, Y);
}

}  // namespace df2q4

// C entries for ctypes (dflash2/native/q4.py): the kernel without ONNX Runtime, one thread.
extern "C" __attribute__((visibility("default"))) int df2_q4_supported() { return df2q4::supported() ? 1 : 0; }

extern "C" __attribute__((visibility("default"))) int df2_q4_matmul(int M, int K, int N, const float* A,
                                                                     const uint8_t* B, const float* S, float* Y) {
  if (!df2q4::supported() || K % 32 != 0 || M <= 0 || N <= 0) return 1;
  void* scratch = ::operator new(df2q4::scratchBytes(M, K));
  df2q4::prepare(0, M, K, A, scratch);
  df2q4::rows(M, K, N, 0, N, B, S, scratch, Y);
  ::operator delete(scratch);
  return 0;
}
