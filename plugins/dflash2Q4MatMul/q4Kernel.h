// The int4 weight MatMul of a decode step, MatMulNBits' arithmetic on MatMulNBits' layout (see README.md).
#pragma once
#include <cstddef>
#include <cstdint>

namespace df2q4 {

// Whether this CPU runs the kernel (AVX512F/BW/VL + AVX512-VNNI); callers fall back to MatMulNBits where not.
bool supported();

// Bytes of scratch `prepare` needs for M rows of K (64-byte aligned blocks inside).
size_t scratchBytes(int M, int K);

// Rows [m0, m1) of A [M, K] -> their activations' int8 blocks in scratch, laid out for the weight loads (rows are
// independent: any split over threads gives the same bytes).
void prepare(int m0, int m1, int K, const float* A, void* scratch);

// Y[m, n] for n in [n0, n1), all m: B uint8 [N, K/32, 16] (low nibble first, zero point 8), S fp32 [N, K/32].
// Every (m, n) is computed by the same instructions in the same order whatever M is: a k-row call equals k
// one-row calls bit for bit (what a lossless verify needs).
void rows(int M, int K, int N, int n0, int n1, const uint8_t* B, const float* S, const void* scratch, float* Y);

}  // namespace df2q4
