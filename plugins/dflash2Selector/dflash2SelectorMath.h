/*
 * DFlash2Selector: the per-element arithmetic shared by the CUDA kernel and the CPU twin.
 *
 * Every function here is compiled twice (nvcc for the device, g++ for the host) so the two
 * implementations cannot drift apart. Rules (dflash2/ops/contract.py):
 *   unary  = softcap(output_multiplier * logit)      softcap(v) = tanh(v / cap) * cap, cap > 0
 *   pair   = sum_r (P[pred, r] * gate[r]) * Q[cand, r]   in fp32, fixed 32-lane summation order
 *   score  = unary + pair, NaN -> -inf
 *   argmax = first maximum (ties: lowest index; all -inf: index 0)
 *   walk   = contract.walk_row: greedy (mode greedy, or T <= 0 / NaN) -> the first argmax, q one-hot;
 *            sample -> e_c = exp((row_c - max) / T), sequential fp32 cdf, inverse CDF with u, clamped
 *            to the candidates with e_c > 0; q_c = e_c / total
 *   confidence = softmax(row)[index] = exp(row[index] - max) / sum_c exp(row[c] - max), c in order
 *                (max -inf -> 0; max +inf -> 1 / number of +inf entries if row[index] is +inf, else 0)
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

/* mode codes of the C ABI (same order as contract.MODES) */
enum { DF2_MODE_GREEDY = 0, DF2_MODE_SAMPLE = 1 };

/* One call of the op. Pointers are host pointers for the CPU twin and device pointers for the
   kernel launcher. Layouts are dense row-major as in the contract:
   cand_logits/cand_ids [B,S,K], gate [B,S,R], anchor [B], codebooks [V,R], uniforms [B,S],
   temperature [B], draft_ids/path_index [B,S], path_scores [B,S,K], confidence [B,S],
   draft_probs [B,S,K]. uniforms and temperature are read in mode DF2_MODE_SAMPLE only (they may be
   NULL in greedy mode). */
typedef struct Df2SelectArgs {
    void const* cand_logits;
    int32_t const* cand_ids;
    void const* gate;
    int32_t const* anchor;
    void const* pred_codebook;
    void const* succ_codebook;
    float const* uniforms;
    float const* temperature;
    int32_t* draft_ids;
    int32_t* path_index;
    float* path_scores;
    float* confidence;
    float* draft_probs;
    int64_t B, S, K, R, V;
    int32_t logits_dtype;   /* DF2_* code of cand_logits */
    int32_t codebook_dtype; /* DF2_* code shared by gate, pred_codebook, succ_codebook */
    float output_multiplier;
    float logit_softcap;
    int32_t mode; /* DF2_MODE_* */
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

DF2_HD float subNoFma(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

DF2_HD float divIeee(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b); /* IEEE division even if someone builds with -prec-div=false */
#else
    return a / b;
#endif
}

/* contract.path_confidence of one walked row: softmax(row)[index] at temperature 1. `best` is the
   row's first argmax (so row[best] = max), `index` the walked candidate (== best when greedy).
   Sequential in c so host and device add in the same order (expf itself may differ by an ulp). */
DF2_HD float pathConfidence(float const* row, int64_t K, int32_t best, int32_t index)
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
            sum = addNoFma(sum, expf(subNoFma(row[c], m))); /* exp(-inf) = 0 */
    }
    if (m == INFINITY)
        return row[index] == INFINITY ? 1.0f / static_cast<float>(nInf) : 0.0f;
    return divIeee(expf(subNoFma(row[index], m)), sum);
}

/* True when the row is walked by the sample rule of contract.walk_row (T > 0; NaN is not). */
DF2_HD bool samples(int32_t mode, float temperature)
{
    return mode == DF2_MODE_SAMPLE && temperature > 0.0f;
}

/* e_c of contract.walk_row's sample rule for a row with maximum m (> -inf) at temperature T > 0:
   0 for -inf; with m = +inf, 1 for +inf entries else 0; otherwise exp((v - m) / T) with the
   subtraction and the division rounded to fp32 and exp taken in double, then rounded to fp32.
   The contract computes exactly that (float64 exp of an fp32 argument, rounded through fp32), so the
   host value is bit-identical to it and the device one is correctly rounded in all but pathological
   ties; an fp32 expf would differ by an ulp now and then, and move a sample sitting on a cdf boundary. */
DF2_HD float sampleWeight(float v, float m, float T)
{
    if (v == -INFINITY)
        return 0.0f;
    if (m == INFINITY)
        return v == INFINITY ? 1.0f : 0.0f;
    return static_cast<float>(exp(static_cast<double>(divIeee(subNoFma(v, m), T))));
}

/* The inverse-CDF step of contract.walk_row given the weights e[0..K-1] (sampleWeight, at least one
   > 0 because the maximum's weight is 1): sequential fp32 cdf, count of cdf_c <= u * total, clamped
   to [first, last] c with e_c > 0. Writes total to *totalOut (q_c = e_c / total). */
DF2_HD int32_t inverseCdf(float const* e, int64_t K, float u, float* totalOut)
{
    float total = 0.0f;
    for (int64_t c = 0; c < K; ++c)
        total = addNoFma(total, e[c]);
    float const thr = mulNoFma(u, total); /* NaN u: no cdf_c <= NaN, so the clamp picks the first */
    float cdf = 0.0f;
    int32_t count = 0;
    int32_t first = -1;
    int32_t last = 0;
    for (int64_t c = 0; c < K; ++c)
    {
        cdf = addNoFma(cdf, e[c]); /* the same additions in the same order as total: cdf_{K-1} == total */
        count += cdf <= thr ? 1 : 0;
        if (e[c] > 0.0f)
        {
            first = first < 0 ? static_cast<int32_t>(c) : first;
            last = static_cast<int32_t>(c);
        }
    }
    *totalOut = total;
    return count < first ? first : count > last ? last : count;
}

/* contract.walk_row of one row on one thread: returns the walked index and writes q to q[0..K-1].
   `best` is the row's first argmax; `e` is scratch for K weights (may alias q). */
DF2_HD int32_t walkRow(float const* row, int64_t K, int32_t best, int32_t mode, float T, float u, float* e, float* q)
{
    float const m = row[best];
    int32_t index = best;
    if (samples(mode, T) && m != -INFINITY)
    {
        for (int64_t c = 0; c < K; ++c)
            e[c] = sampleWeight(row[c], m, T);
        float total = 1.0f;
        index = inverseCdf(e, K, u, &total);
        for (int64_t c = 0; c < K; ++c)
            q[c] = divIeee(e[c], total);
        return index;
    }
    /* greedy, or nothing scored (all -inf: index 0 == best in both modes): q one-hot */
    for (int64_t c = 0; c < K; ++c)
        q[c] = c == index ? 1.0f : 0.0f;
    return index;
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
