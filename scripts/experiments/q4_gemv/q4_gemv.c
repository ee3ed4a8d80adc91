// A one-row int4 GEMV with MatMulNBits' CompInt8 arithmetic (issue 50's experiment; nothing here ships):
// B is MatMulNBits' own layout, uint8 [N, K/32, 16], two 4-bit weights a byte (low nibble first), zero point 8
// (symmetric, no zero-point input), fp32 scales [N, K/32]. A is quantized to int8 per block of 32
// (scale amax/127, round to nearest even), each block's dot product is an integer, blocks sum in fp32.
// What differs from MLAS's kernel is the memory side: rows are walked in order, with a software prefetch PF bytes
// ahead (compile with -DPF=8192; without it, only the hardware prefetchers), so a decode step whose weights sit in
// DRAM streams them instead of waiting on each line.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// A [K] -> the layout of one 64-byte weight load (128 weights, 4 blocks): byte j holds block j/16's elements
// 2(j%16) (low nibble) and 2(j%16)+1 (high). alo / ahi: int8 [C, 64]; ncorr: int32 [C, 16], -8 x the 8 activations
// a lane multiplies (the zero point); asl: fp32 [C, 16], each lane's block scale. C = ceil(K / 128), tail zeroed.
void q4_prep(int K, const float* a, int8_t* alo, int8_t* ahi, int32_t* ncorr, float* asl) {
  int C = (K + 127) / 128, nb = K / 32;
  memset(alo, 0, C * 64); memset(ahi, 0, C * 64);
  memset(ncorr, 0, C * 64); memset(asl, 0, C * 64);
  for (int b = 0; b < nb; b++) {
    const float* x = a + 32 * b;
    float m = 0.f;
    for (int i = 0; i < 32; i++) m = fmaxf(m, fabsf(x[i]));
    float inv = m > 0 ? 127.f / m : 0.f;
    int c = b / 4, jb = (b % 4) * 16;
    for (int i = 0; i < 16; i++) {
      int lo = (int)nearbyintf(x[2 * i] * inv), hi = (int)nearbyintf(x[2 * i + 1] * inv);
      alo[c * 64 + jb + i] = (int8_t)lo;
      ahi[c * 64 + jb + i] = (int8_t)hi;
      ncorr[c * 16 + (jb + i) / 4] -= 8 * (lo + hi);
    }
    for (int l = 0; l < 4; l++) asl[c * 16 + (b % 4) * 4 + l] = m / 127.f;
  }
}

// y[n] for n in [n0, n1): per 128 weights one load, two VNNI dot products (low / high nibbles) into 16 int32
// lanes (4 a block), then fp32: lanes x (weight scale x activation scale), one reduction per row at the end.
void q4_gemv(int K, int n0, int n1, const uint8_t* B, const float* S, const int8_t* alo, const int8_t* ahi,
             const int32_t* ncorr, const float* asl, float* y) {
  int C = (K + 127) / 128, nb = K / 32, rb = K / 2, tail = (K % 128) / 32;
  __mmask64 bm = tail ? (((__mmask64)1 << (16 * tail)) - 1) : ~(__mmask64)0;
  __mmask8 sm = tail ? (__mmask8)((1 << tail) - 1) : (__mmask8)0xF;
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int n = n0; n < n1; n++) {
    const uint8_t* b = B + (size_t)n * rb;
    const float* s = S + (size_t)n * nb;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < C; c++) {
#ifdef PF
      _mm_prefetch((const char*)(b + 64 * c + PF), _MM_HINT_T0);
      if ((c & 3) == 0) _mm_prefetch((const char*)(s + 4 * c + PF / 4), _MM_HINT_T0);
#endif
      int part = (c == C - 1) && tail;
      __m512i w = part ? _mm512_maskz_loadu_epi8(bm, b + 64 * c) : _mm512_loadu_si512(b + 64 * c);
      __m128 ws = part ? _mm_maskz_loadu_ps(sm, s + 4 * c) : _mm_loadu_ps(s + 4 * c);
      __m512i d = _mm512_loadu_si512(ncorr + 16 * c);
      d = _mm512_dpbusd_epi32(d, _mm512_and_si512(w, lo4), _mm512_loadu_si512(alo + 64 * c));
      d = _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4), _mm512_loadu_si512(ahi + 64 * c));
      __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(ws)), _mm512_loadu_ps(asl + 16 * c));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc);
    }
    y[n] = _mm512_reduce_add_ps(acc);
  }
}

// A decode step's weight MatMuls in order (L of them), each on a fixed input of its K, the rows split between
// OpenMP threads (one per core). scratch: alo, ahi (int8, 64 C), ncorr (int32, 16 C), asl (fp32, 16 C) for C
// of the largest K; y holds the largest N.
void q4_chain(int L, const int* Ks, const int* Ns, const uint8_t** Bs, const float** Ss, const float** xs,
              int8_t* alo, int8_t* ahi, int32_t* nc, float* asl, float* y) {
#pragma omp parallel
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int l = 0; l < L; l++) {
#pragma omp single
      q4_prep(Ks[l], xs[l], alo, ahi, nc, asl);
      int N = Ns[l], per = (N / T + 15) / 16 * 16, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
      if (n0 < N) q4_gemv(Ks[l], n0, n1, Bs[l], Ss[l], alo, ahi, nc, asl, y);
#pragma omp barrier
    }
  }
}

// The streaming ceiling: read n floats (a multiple of 128) with eight independent accumulators, split between
// the OpenMP threads.
float stream_read(const float* p, size_t n) {
  float total = 0.f;
#pragma omp parallel reduction(+ : total)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    size_t per = (n / 128 / T) * 128, i0 = t * per, i1 = t == T - 1 ? n : i0 + per;
    __m512 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_ps();
    for (size_t i = i0; i < i1; i += 128)
      for (int k = 0; k < 8; k++) a[k] = _mm512_add_ps(a[k], _mm512_loadu_ps(p + i + 16 * k));
    for (int k = 1; k < 8; k++) a[0] = _mm512_add_ps(a[0], a[k]);
    total = _mm512_reduce_add_ps(a[0]);
  }
  return total;
}
