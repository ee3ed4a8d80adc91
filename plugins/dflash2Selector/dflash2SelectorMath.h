/*
 * DFlash2Selector: the per-element arithmetic shared by the CUDA kernel and the CPU twin.
 *
 * Every function here is compiled twice (nvcc for the device, g++ for the host) so the two
 * implementations cannot drift apart. Rules (dflash2/ops/contract.py):
 *   unary  = softcap(output_multiplier * logit)      softcap(v) = tanh(v / cap) * cap, cap > 0
 *   pair   = sum_r (P[pred, r] * gate[r]) * Q[cand, r]   in fp32, fixed 32-lane summation order
 *   score  = unary + pair, NaN -> -inf
 *   argmax = first maximum (ties: lowest index; all -inf: index 0)
 *   confidence = softmax(row)[argmax] = 1 / sum_c exp(row[c] - max), c in order
 *                (max -inf -> 0; max +inf -> 1 / number of +inf entries)
 * No fast-math anywhere: the NaN rule and the tie rule need IEEE comparisons, and products are
 * rounded separately (no FMA contraction) so host and device sums are bit-identical.
 */
#ifndef DFLASH2_SELECTOR_MATH_H
#define DFLASH2_SELECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DF2_HD __host__ __device__ __forceinline__
#else
#define DF2_HD inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes of the C ABI (same order as contract.FLOAT_TYPES) */
enum { DF2_FLOAT32 = 0, DF2_FLOAT16 = 1, DF2_BFLOAT16 = 2 };

enum { DF2_MAX_TOP_K = 64, DF2_MAX_RANK = 1024, DF2_LANES = 32 };

/* One call of the op. Pointers are host pointers for the CPU twin and device pointers for the
   kernel launcher. Layouts are dense row-major as in the contract:
   cand_logits/cand_ids [B,S,K], gate [B,S,R], anchor [B], codebooks [V,R],
   draft_ids/path_index [B,S], path_scores [B,S,K], confidence [B,S]. */
typedef struct Df2SelectArgs {
    void const* cand_logits;
    int32_t const* cand_ids;
    void const* gate;
    int32_t const* anchor;
    void const* pred_codebook;
    void const* succ_codebook;
    int32_t* draft_ids;
    int32_t* path_index;
    float* path_scores;
    float* confidence;
    int64_t B, S, K, R, V;
    int32_t logits_dtype;   /* DF2_* code of cand_logits */
    int32_t codebook_dtype; /* DF2_* code shared by gate, pred_codebook, succ_codebook */
    float output_multiplier;
    float logit_softcap;
} Df2SelectArgs;

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
namespace dflash2
{

DF2_HD float bitsToFloat(uint32_t bits)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

DF2_HD float halfToFloat(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu)
        return bitsToFloat(sign | 0x7f800000u | (man << 13)); /* inf / NaN */
    if (exp == 0)
    {
        if (man == 0)
            return bitsToFloat(sign);
        exp = 113; /* subnormal: renormalise */
        while ((man & 0x400u) == 0)
        {
            man <<= 1;
            --exp;
        }
        return bitsToFloat(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    return bitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

DF2_HD float bf16ToFloat(uint16_t h)
{
    return bitsToFloat(static_cast<uint32_t>(h) << 16);
}

/* Element i of a float tensor stored as DT (fp16/bf16 read as raw 16-bit patterns). */
template <int DT>
DF2_HD float loadAsFloat(void const* base, int64_t i)
{
    if (DT == DF2_FLOAT32)
        return static_cast<float const*>(base)[i];
    uint16_t const h = static_cast<uint16_t const*>(base)[i];
    return DT == DF2_FLOAT16 ? halfToFloat(h) : bf16ToFloat(h);
}

DF2_HD float mulNoFma(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b); /* never contracted into an FMA */
#else
    return a * b; /* host code is built with -ffp-contract=off */
#endif
}

DF2_HD float addNoFma(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

DF2_HD float unaryScore(float logit, float multiplier, float softcap)
{
    float const v = mulNoFma(logit, multiplier);
    return softcap > 0.0f ? mulNoFma(tanhf(v / softcap), softcap) : v;
}

/* score = unary + pair with the contract's NaN rule (+inf stays +inf). */
DF2_HD float pairScore(float unary, float pair)
{
    float const v = addNoFma(unary, pair);
    return v != v ? -INFINITY : v;
}

/* Total order used by every argmax: larger value first, then lower index. NaN never reaches it. */
DF2_HD bool isBetter(float v, int32_t i, float bestV, int32_t bestI)
{
    return v > bestV || (v == bestV && i < bestI);
}

DF2_HD bool validId(int32_t id, int64_t V)
{
    return id >= 0 && static_cast<int64_t>(id) < V;
}

/* contract.path_confidence of one walked row (best = its first argmax); sequential in c so host and
   device add in the same order (expf itself may differ by an ulp between the two). */
DF2_HD float pathConfidence(float const* row, int64_t K, int32_t best)
{
    float const m = row[best];
    if (m == -INFINITY)
        return 0.0f;
    float sum = 0.0f;
    int32_t nInf = 0;
    for (int64_t c = 0; c < K; ++c)
    {
        if (m == INFINITY)
            nInf += row[c] == INFINITY ? 1 : 0;
        else
            sum = addNoFma(sum, expf(row[c] - m)); /* exp(-inf) = 0 */
    }
    return m == INFINITY ? 1.0f / static_cast<float>(nInf) : 1.0f / sum;
}

/* Lane `lane`'s share of dot(w, Q[row]) : r = lane, lane + 32, ... summed in that order. */
template <int DT>
DF2_HD float lanePartial(float const* w, void const* q, int64_t rowOffset, int64_t R, int lane)
{
    float acc = 0.0f;
    for (int64_t r = lane; r < R; r += DF2_LANES)
        acc = addNoFma(acc, mulNoFma(w[r], loadAsFloat<DT>(q, rowOffset + r)));
    return acc;
}

} // namespace dflash2
#endif // __cplusplus

#endif // DFLASH2_SELECTOR_MATH_H
