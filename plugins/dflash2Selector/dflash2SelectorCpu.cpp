/*
 * DFlash2Selector CPU twin: the kernel's arithmetic, element for element, on the host.
 * Same summation order as the kernel's warp reduction (see dflash2SelectorMath.h), so for
 * softcap = 0 the CPU and GPU scores are bit-identical; the walk (walkRow) is the same code too.
 */
#include "dflash2SelectorCpu.h"

#include <cstdarg>
#include <cstdio>

namespace
{

int32_t fail(char* err, size_t errLen, char const* fmt, ...)
{
    if (err != nullptr && errLen > 0)
    {
        va_list ap;
        va_start(ap, fmt);
        std::vsnprintf(err, errLen, fmt, ap);
        va_end(ap);
    }
    return 1;
}

/* Lanes summed pairwise exactly as the kernel's __shfl_xor_sync butterfly leaves lane 0. */
template <int DT>
float dotLanes(float const* w, void const* q, int64_t rowOffset, int64_t R)
{
    float part[DF2_LANES];
    for (int lane = 0; lane < DF2_LANES; ++lane)
        part[lane] = dflash2::lanePartial<DT>(w, q, rowOffset, R, lane);
    for (int offset = DF2_LANES / 2; offset > 0; offset /= 2)
        for (int i = 0; i < offset; ++i)
            part[i] = dflash2::addNoFma(part[i], part[i + offset]);
    return part[0];
}

template <int TL, int TC>
void selectPath(Df2SelectArgs const& a)
{
    using namespace dflash2;
    float w[DF2_MAX_RANK];
    float row[DF2_MAX_TOP_K];
    for (int64_t b = 0; b < a.B; ++b)
    {
        int32_t prev = 0;
        for (int64_t s = 0; s < a.S; ++s)
        {
            int64_t const bs = b * a.S + s;
            int32_t const predId = s == 0 ? a.anchor[b] : a.cand_ids[(bs - 1) * a.K + prev];
            for (int64_t r = 0; r < a.R; ++r)
                w[r] = validId(predId, a.V)
                    ? mulNoFma(loadAsFloat<TC>(a.pred_codebook, predId * a.R + r), loadAsFloat<TC>(a.gate, bs * a.R + r))
                    : NAN;
            int32_t best = 0;
            for (int32_t c = 0; c < a.K; ++c)
            {
                int32_t const id = a.cand_ids[bs * a.K + c];
                float const pair = validId(id, a.V) ? dotLanes<TC>(w, a.succ_codebook, id * a.R, a.R) : NAN;
                float const unary = unaryScore(loadAsFloat<TL>(a.cand_logits, bs * a.K + c), a.output_multiplier,
                    a.logit_softcap);
                row[c] = pairScore(unary, pair);
                if (isBetter(row[c], c, row[best], best))
                    best = c;
            }
            for (int32_t c = 0; c < a.K; ++c)
                a.path_scores[bs * a.K + c] = row[c];
            // uniforms / temperature are read only by a sample-mode walk (NULL is allowed in greedy mode)
            float const T = a.mode == DF2_MODE_SAMPLE ? a.temperature[b] : 0.0f;
            float const u = samples(a.mode, T) ? a.uniforms[bs] : 0.0f;
            float* q = a.draft_probs + bs * a.K;
            int32_t const index = walkRow(row, a.K, best, a.mode, T, u, q, q);
            a.path_index[bs] = index;
            a.confidence[bs] = pathConfidence(row, a.K, best, index);
            a.draft_ids[bs] = a.cand_ids[bs * a.K + index];
            prev = index; // the walk continues from the candidate actually chosen
        }
    }
}

template <int TL>
void dispatchCodebook(Df2SelectArgs const& a)
{
    switch (a.codebook_dtype)
    {
    case DF2_FLOAT32: selectPath<TL, DF2_FLOAT32>(a); break;
    case DF2_FLOAT16: selectPath<TL, DF2_FLOAT16>(a); break;
    default: selectPath<TL, DF2_BFLOAT16>(a); break;
    }
}

} // namespace

extern "C" DF2_API int32_t dflash2_selector_abi_version(void)
{
    return 3; /* 2: Df2SelectArgs gained `confidence`; 3: uniforms, temperature, draft_probs, mode */
}

extern "C" DF2_API int32_t dflash2_check_select_args(Df2SelectArgs const* a, char* err, size_t errLen)
{
    if (a == nullptr)
        return fail(err, errLen, "DFlash2Selector: args is NULL");
    if (a->K < 1 || a->K > DF2_MAX_TOP_K)
        return fail(err, errLen, "DFlash2Selector: K (top_k) expected 1..%d, found %lld", DF2_MAX_TOP_K,
            static_cast<long long>(a->K));
    if (a->R < 1 || a->R > DF2_MAX_RANK)
        return fail(err, errLen, "DFlash2Selector: R (rank) expected 1..%d, found %lld", DF2_MAX_RANK,
            static_cast<long long>(a->R));
    if (a->B < 0 || a->S < 0 || a->V < 1)
        return fail(err, errLen, "DFlash2Selector: sizes expected B >= 0, S >= 0, V >= 1, found B=%lld S=%lld V=%lld",
            static_cast<long long>(a->B), static_cast<long long>(a->S), static_cast<long long>(a->V));
    if (a->logits_dtype < DF2_FLOAT32 || a->logits_dtype > DF2_BFLOAT16)
        return fail(err, errLen, "DFlash2Selector: cand_logits dtype code expected 0..2, found %d", a->logits_dtype);
    if (a->codebook_dtype < DF2_FLOAT32 || a->codebook_dtype > DF2_BFLOAT16)
        return fail(err, errLen, "DFlash2Selector: codebook dtype code expected 0..2, found %d", a->codebook_dtype);
    if (!(a->output_multiplier > 0.0f))
        return fail(err, errLen, "DFlash2Selector: output_multiplier expected > 0, found %g",
            static_cast<double>(a->output_multiplier));
    if (!(a->logit_softcap >= 0.0f))
        return fail(err, errLen, "DFlash2Selector: logit_softcap expected >= 0, found %g",
            static_cast<double>(a->logit_softcap));
    if (a->mode != DF2_MODE_GREEDY && a->mode != DF2_MODE_SAMPLE)
        return fail(err, errLen, "DFlash2Selector: mode code expected 0 (greedy) or 1 (sample), found %d", a->mode);
    void const* ptrs[] = {a->cand_logits, a->cand_ids, a->gate, a->anchor, a->pred_codebook, a->succ_codebook,
        a->draft_ids, a->path_index, a->path_scores, a->confidence, a->draft_probs, a->uniforms, a->temperature};
    char const* names[] = {"cand_logits", "cand_ids", "gate", "anchor", "pred_codebook", "succ_codebook",
        "draft_ids", "path_index", "path_scores", "confidence", "draft_probs", "uniforms", "temperature"};
    int const needed = a->mode == DF2_MODE_SAMPLE ? 13 : 11; // greedy reads neither uniforms nor temperature
    if (a->B > 0 && a->S > 0)
        for (int i = 0; i < needed; ++i)
            if (ptrs[i] == nullptr)
                return fail(err, errLen, "DFlash2Selector: tensor %s is NULL", names[i]);
    return 0;
}

extern "C" DF2_API int32_t dflash2_select_path_cpu(Df2SelectArgs const* a, char* err, size_t errLen)
{
    if (dflash2_check_select_args(a, err, errLen) != 0)
        return 1;
    switch (a->logits_dtype)
    {
    case DF2_FLOAT32: dispatchCodebook<DF2_FLOAT32>(*a); break;
    case DF2_FLOAT16: dispatchCodebook<DF2_FLOAT16>(*a); break;
    default: dispatchCodebook<DF2_BFLOAT16>(*a); break;
    }
    return 0;
}
