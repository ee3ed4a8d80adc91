// MatMulNBits' CompInt8 arithmetic (accuracy_level 4, block 32, 4 bits, no zero-point input = 8), one weight row
// at a time: the activations are quantized to int8 per block of 32 (scale amax / 127, round half to even), each
// block's dot product is an integer (two AVX512-VNNI dot products per 128 weights, one for the low nibbles, one for
// the high), blocks are summed in fp32 per 16-lane accumulator and reduced once per output. What makes it faster
// than MLAS at one row is the memory side: rows are walked in order with a software prefetch PF bytes ahead, so a
// step whose weights sit in DRAM streams them (scripts/experiments/q4_gemv.py measures it).
#include "q4Kernel.h"

// GCC 12 flags its own _mm512_undefined_* placeholders inside the AVX512 intrinsics as maybe-uninitialized
// once they are inlined here (a known false positive); nothing of ours is.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace df2q4 {
namespace {

constexpr int kPrefetch = 8192;  // bytes ahead of the weight load (the experiment's best of 1-32 KiB)
constexpr int kRowGroup = 4;     // activation rows sharing one decoded weight chunk

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

void prepare(int M, int K, const float* A, void* scratch) {
  const int C = chunks(K), nb = K / 32;
  Chunk* out = aligned(scratch);
  std::memset(static_cast<void*>(out), 0, static_cast<size_t>(M) * C * sizeof(Chunk));
  for (int m = 0; m < M; ++m) {
    Chunk* row = out + static_cast<size_t>(m) * C;
    for (int b = 0; b < nb; ++b) {
      const float* x = A + static_cast<size_t>(m) * K + 32 * b;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      Chunk& c = row[b / 4];
      const int jb = (b % 4) * 16;
      for (int i = 0; i < 16; ++i) {
        const int lo = static_cast<int>(std::nearbyint(x[2 * i] * inv));
        const int hi = static_cast<int>(std::nearbyint(x[2 * i + 1] * inv));
        c.lo[jb + i] = static_cast<int8_t>(lo);
        c.hi[jb + i] = static_cast<int8_t>(hi);
        c.ncorr[(jb + i) / 4] -= 8 * (lo + hi);
      }
      for (int l = 0; l < 4; ++l) c.scale[(b % 4) * 4 + l] = amax / 127.f;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void rows(int M, int K, int N, int n0, int n1, const uint8_t* B, const float* S, const void* scratch, float* Y) {
  const int C = chunks(K), nb = K / 32, rb = K / 2, tail = (K % 128) / 32;
  const __mmask64 bm = tail ? ((static_cast<__mmask64>(1) << (16 * tail)) - 1) : ~static_cast<__mmask64>(0);
  const __mmask8 sm = tail ? static_cast<__mmask8>((1 << tail) - 1) : static_cast<__mmask8>(0xF);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const Chunk* act = aligned(scratch);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* b = B + static_cast<size_t>(n) * rb;
    const float* s = S + static_cast<size_t>(n) * nb;
    for (int m0 = 0; m0 < M; m0 += kRowGroup) {
      const int g = M - m0 < kRowGroup ? M - m0 : kRowGroup;
      __m512 acc[kRowGroup];
      for (int j = 0; j < kRowGroup; ++j) acc[j] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(b + 64 * c + kPrefetch), _MM_HINT_T0);
        if (m0 == 0 && (c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + 4 * c + kPrefetch / 4), _MM_HINT_T0);
        const bool part = (c == C - 1) && tail;
        const __m512i w = part ? _mm512_maskz_loadu_epi8(bm, b + 64 * c) : _mm512_loadu_si512(b + 64 * c);
        const __m128 ws = part ? _mm_maskz_loadu_ps(sm, s + 4 * c) : _mm_loadu_ps(s + 4 * c);
        const __m512i wlo = _mm512_and_si512(w, lo4);
        const __m512i whi = _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4);
        const __m512 wsl = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(ws));
        for (int j = 0; j < g; ++j) {
          const Chunk& a = act[static_cast<size_t>(m0 + j) * C + c];
          __m512i d = _mm512_load_si512(a.ncorr);
          d = _mm512_dpbusd_epi32(d, wlo, _mm512_load_si512(a.lo));
          d = _mm512_dpbusd_epi32(d, whi, _mm512_load_si512(a.hi));
          acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wsl, _mm512_load_ps(a.scale)), acc[j]);
        }
      }
      for (int j = 0; j < g; ++j) Y[static_cast<size_t>(m0 + j) * N + n] = _mm512_reduce_add_ps(acc[j]);
    }
  }
}

}  // namespace df2q4

// C entries for ctypes (dflash2/native/q4.py): the kernel without ONNX Runtime, one thread.
extern "C" __attribute__((visibility("default"))) int df2_q4_supported() { return df2q4::supported() ? 1 : 0; }

extern "C" __attribute__((visibility("default"))) int df2_q4_matmul(int M, int K, int N, const float* A,
                                                                     const uint8_t* B, const float* S, float* Y) {
  if (!df2q4::supported() || K % 32 != 0 || M <= 0 || N <= 0) return 1;
  void* scratch = ::operator new(df2q4::scratchBytes(M, K));
  df2q4::prepare(M, K, A, scratch);
  df2q4::rows(M, K, N, 0, N, B, S, scratch, Y);
  ::operator delete(scratch);
  return 0;
}
