/*
 * DFlash2Selector CUDA kernel: codebook pair scores + greedy walk, fused in one launch.
 *
 * Grid: one block per batch element. Block: min(K, 16) warps. For each draft position s, in
 * order (the walk is sequential): the block forms w = P[pred] * gate_s in shared memory, each
 * warp scores its candidates c (dot(w, Q[cand_c]) over 32 lanes + unary), warp 0 takes the
 * first argmax, walks the row (contract.walk_row: greedy, or inverse-CDF sampling with the row's
 * uniform), writes q and the walked candidate's softmax confidence, and the chosen index becomes
 * the next predecessor. Only the S walked rows of
 * K dot products are computed, never the S*K*K lattice.
 */
#include "dflash2SelectorCpu.h"
#include "dflash2SelectorKernel.h"

#include <cstdio>
#include <vector>

namespace dflash2
{
namespace
{

constexpr int kMaxWarps = 16;
constexpr unsigned kFullMask = 0xffffffffu;

template <int TL, int TC>
__global__ void selectPathKernel(Df2SelectArgs a)
{
    __shared__ float w[DF2_MAX_RANK];
    __shared__ float row[DF2_MAX_TOP_K];
    __shared__ float e[DF2_MAX_TOP_K]; // sample-mode weights of the walked row
    __shared__ int32_t chosen;

    int64_t const b = blockIdx.x;
    int const lane = threadIdx.x % DF2_LANES;
    int const warp = threadIdx.x / DF2_LANES;
    int const nWarps = blockDim.x / DF2_LANES;
    int32_t prev = 0;

    for (int64_t s = 0; s < a.S; ++s)
    {
        int64_t const bs = b * a.S + s;
        int32_t const predId = s == 0 ? a.anchor[b] : a.cand_ids[(bs - 1) * a.K + prev];
        bool const predOk = validId(predId, a.V);
        for (int64_t r = threadIdx.x; r < a.R; r += blockDim.x)
            w[r] = predOk ? mulNoFma(loadAsFloat<TC>(a.pred_codebook, predId * a.R + r),
                                loadAsFloat<TC>(a.gate, bs * a.R + r))
                          : NAN;
        __syncthreads();

        for (int c = warp; c < a.K; c += nWarps)
        {
            int32_t const id = a.cand_ids[bs * a.K + c];
            float pair = validId(id, a.V) ? lanePartial<TC>(w, a.succ_codebook, id * a.R, a.R, lane) : NAN;
            for (int offset = DF2_LANES / 2; offset > 0; offset /= 2)
                pair = addNoFma(pair, __shfl_xor_sync(kFullMask, pair, offset));
            if (lane == 0)
            {
                float const unary
                    = unaryScore(loadAsFloat<TL>(a.cand_logits, bs * a.K + c), a.output_multiplier, a.logit_softcap);
                row[c] = pairScore(unary, pair);
            }
        }
        __syncthreads();

        if (warp == 0)
        {
            // Candidates lane and lane+32; padding is -inf with an index >= K, so it never wins.
            float bestV = lane < a.K ? row[lane] : -INFINITY;
            int32_t bestI = lane;
            if (lane + DF2_LANES < a.K && isBetter(row[lane + DF2_LANES], lane + DF2_LANES, bestV, bestI))
            {
                bestV = row[lane + DF2_LANES];
                bestI = lane + DF2_LANES;
            }
            for (int offset = DF2_LANES / 2; offset > 0; offset /= 2)
            {
                float const v = __shfl_xor_sync(kFullMask, bestV, offset);
                int32_t const i = __shfl_xor_sync(kFullMask, bestI, offset);
                if (isBetter(v, i, bestV, bestI))
                {
                    bestV = v;
                    bestI = i;
                }
            }
            // The xor butterfly leaves every lane with the first argmax. Then contract.walk_row: in
            // sample mode each lane weighs its candidates (lane, lane + 32) in parallel, lane 0 runs the
            // sequential cdf (the CPU twin's order), every lane writes its share of q.
            // uniforms / temperature are read only by a sample-mode walk, one element each, in bounds.
            float* q = a.draft_probs + bs * a.K;
            float const T = a.mode == DF2_MODE_SAMPLE ? a.temperature[b] : 0.0f;
            int32_t index = bestI;
            if (samples(a.mode, T) && bestV != -INFINITY)
            {
                for (int c = lane; c < a.K; c += DF2_LANES)
                    e[c] = sampleWeight(row[c], bestV, T);
                __syncwarp();
                float total = 1.0f;
                if (lane == 0)
                    index = inverseCdf(e, a.K, a.uniforms[bs], &total);
                index = __shfl_sync(kFullMask, index, 0);
                total = __shfl_sync(kFullMask, total, 0);
                for (int c = lane; c < a.K; c += DF2_LANES)
                    q[c] = divIeee(e[c], total);
            }
            else
                for (int c = lane; c < a.K; c += DF2_LANES)
                    q[c] = c == index ? 1.0f : 0.0f;
            if (lane == 0)
            {
                chosen = index;
                a.path_index[bs] = index;
                a.draft_ids[bs] = a.cand_ids[bs * a.K + index];
                // K <= 64 terms: one lane, CPU twin's order
                a.confidence[bs] = pathConfidence(row, a.K, bestI, index);
            }
        }
        for (int c = threadIdx.x; c < a.K; c += blockDim.x)
            a.path_scores[bs * a.K + c] = row[c];
        __syncthreads();
        prev = chosen; // the walk continues from the candidate actually chosen
    }
}

template <int TL>
void launchForCodebook(Df2SelectArgs const& a, dim3 grid, dim3 block, cudaStream_t stream)
{
    switch (a.codebook_dtype)
    {
    case DF2_FLOAT32: selectPathKernel<TL, DF2_FLOAT32><<<grid, block, 0, stream>>>(a); break;
    case DF2_FLOAT16: selectPathKernel<TL, DF2_FLOAT16><<<grid, block, 0, stream>>>(a); break;
    default: selectPathKernel<TL, DF2_BFLOAT16><<<grid, block, 0, stream>>>(a); break;
    }
}

size_t elementSize(int32_t dtype)
{
    return dtype == DF2_FLOAT32 ? 4 : 2;
}

int32_t cudaFail(char* err, size_t errLen, char const* what, cudaError_t status)
{
    if (err != nullptr && errLen > 0)
        std::snprintf(err, errLen, "DFlash2Selector: %s failed: %s", what, cudaGetErrorString(status));
    return 1;
}

} // namespace

cudaError_t launchSelectPath(Df2SelectArgs const& a, cudaStream_t stream)
{
    if (a.B == 0 || a.S == 0)
        return cudaSuccess;
    int const warps = static_cast<int>(a.K < kMaxWarps ? a.K : kMaxWarps);
    dim3 const grid(static_cast<unsigned>(a.B));
    dim3 const block(static_cast<unsigned>(warps * DF2_LANES));
    switch (a.logits_dtype)
    {
    case DF2_FLOAT32: launchForCodebook<DF2_FLOAT32>(a, grid, block, stream); break;
    case DF2_FLOAT16: launchForCodebook<DF2_FLOAT16>(a, grid, block, stream); break;
    default: launchForCodebook<DF2_BFLOAT16>(a, grid, block, stream); break;
    }
    return cudaGetLastError();
}

} // namespace dflash2

namespace
{

//! Device copies of one call's tensors, freed on every path out.
struct DeviceCall
{
    struct Buf
    {
        void const* host; // input to upload, or nullptr
        void* out;        // output to download, or nullptr
        size_t bytes;
        void* dev;
    };
    std::vector<Buf> bufs;
    cudaEvent_t start{nullptr};
    cudaEvent_t stop{nullptr};

    ~DeviceCall()
    {
        for (Buf& buf : bufs)
            if (buf.dev != nullptr)
                cudaFree(buf.dev);
        if (start != nullptr)
            cudaEventDestroy(start);
        if (stop != nullptr)
            cudaEventDestroy(stop);
    }
};

char const* runOnDevice(Df2SelectArgs const& h, int32_t timingIters, float* usPerCall, cudaError_t& st)
{
    size_t const tl = dflash2::elementSize(h.logits_dtype);
    size_t const tc = dflash2::elementSize(h.codebook_dtype);
    size_t const bs = static_cast<size_t>(h.B * h.S);
    size_t const vr = static_cast<size_t>(h.V * h.R);
    DeviceCall call;
    call.bufs = {{h.cand_logits, nullptr, bs * h.K * tl, nullptr}, {h.cand_ids, nullptr, bs * h.K * 4, nullptr},
        {h.gate, nullptr, bs * h.R * tc, nullptr}, {h.anchor, nullptr, static_cast<size_t>(h.B) * 4, nullptr},
        {h.pred_codebook, nullptr, vr * tc, nullptr}, {h.succ_codebook, nullptr, vr * tc, nullptr},
        {h.uniforms, nullptr, h.uniforms != nullptr ? bs * 4 : 0, nullptr},
        {h.temperature, nullptr, h.temperature != nullptr ? static_cast<size_t>(h.B) * 4 : 0, nullptr},
        {nullptr, h.draft_ids, bs * 4, nullptr}, {nullptr, h.path_index, bs * 4, nullptr},
        {nullptr, h.path_scores, bs * h.K * 4, nullptr}, {nullptr, h.confidence, bs * 4, nullptr},
        {nullptr, h.draft_probs, bs * h.K * 4, nullptr}};
    for (DeviceCall::Buf& buf : call.bufs)
    {
        if ((st = cudaMalloc(&buf.dev, buf.bytes > 0 ? buf.bytes : 1)) != cudaSuccess)
            return "cudaMalloc";
        if (buf.host != nullptr && buf.bytes > 0
            && (st = cudaMemcpy(buf.dev, buf.host, buf.bytes, cudaMemcpyHostToDevice)) != cudaSuccess)
            return "cudaMemcpy to device";
    }
    Df2SelectArgs d = h;
    d.cand_logits = call.bufs[0].dev;
    d.cand_ids = static_cast<int32_t const*>(call.bufs[1].dev);
    d.gate = call.bufs[2].dev;
    d.anchor = static_cast<int32_t const*>(call.bufs[3].dev);
    d.pred_codebook = call.bufs[4].dev;
    d.succ_codebook = call.bufs[5].dev;
    // greedy mode may pass NULL uniforms / temperature: the kernel then gets NULL too, and reads neither
    d.uniforms = h.uniforms != nullptr ? static_cast<float const*>(call.bufs[6].dev) : nullptr;
    d.temperature = h.temperature != nullptr ? static_cast<float const*>(call.bufs[7].dev) : nullptr;
    d.draft_ids = static_cast<int32_t*>(call.bufs[8].dev);
    d.path_index = static_cast<int32_t*>(call.bufs[9].dev);
    d.path_scores = static_cast<float*>(call.bufs[10].dev);
    d.confidence = static_cast<float*>(call.bufs[11].dev);
    d.draft_probs = static_cast<float*>(call.bufs[12].dev);
    if ((st = dflash2::launchSelectPath(d, nullptr)) != cudaSuccess || (st = cudaDeviceSynchronize()) != cudaSuccess)
        return "kernel";
    for (DeviceCall::Buf& buf : call.bufs)
        if (buf.out != nullptr && buf.bytes > 0
            && (st = cudaMemcpy(buf.out, buf.dev, buf.bytes, cudaMemcpyDeviceToHost)) != cudaSuccess)
            return "cudaMemcpy to host";
    if (timingIters <= 0 || usPerCall == nullptr)
        return nullptr;
    if ((st = cudaEventCreate(&call.start)) != cudaSuccess || (st = cudaEventCreate(&call.stop)) != cudaSuccess
        || (st = cudaEventRecord(call.start, nullptr)) != cudaSuccess)
        return "cudaEvent setup";
    for (int32_t i = 0; i < timingIters && st == cudaSuccess; ++i)
        st = dflash2::launchSelectPath(d, nullptr);
    float ms = 0.0f;
    if (st != cudaSuccess || (st = cudaEventRecord(call.stop, nullptr)) != cudaSuccess
        || (st = cudaEventSynchronize(call.stop)) != cudaSuccess
        || (st = cudaEventElapsedTime(&ms, call.start, call.stop)) != cudaSuccess)
        return "timed launches";
    *usPerCall = ms * 1000.0f / static_cast<float>(timingIters);
    return nullptr;
}

} // namespace

extern "C" DF2_API int32_t dflash2_select_path_cuda(
    Df2SelectArgs const* host, int32_t timingIters, float* usPerCall, char* err, size_t errLen)
{
    if (dflash2_check_select_args(host, err, errLen) != 0)
        return 1;
    if (host->B > 0x7fffffff)
        return dflash2::cudaFail(err, errLen, "grid size check (B > 2^31-1)", cudaErrorInvalidValue);
    cudaError_t st = cudaSuccess;
    char const* what = runOnDevice(*host, timingIters, usPerCall, st);
    return what == nullptr ? 0 : dflash2::cudaFail(err, errLen, what, st);
}

extern "C" DF2_API int32_t dflash2_launch_select_path(
    Df2SelectArgs const* args, void* stream, char* err, size_t errLen)
{
    if (dflash2_check_select_args(args, err, errLen) != 0)
        return 1;
    if (args->B > 0x7fffffff)
        return dflash2::cudaFail(err, errLen, "grid size check (B > 2^31-1)", cudaErrorInvalidValue);
    cudaError_t const st = dflash2::launchSelectPath(*args, static_cast<cudaStream_t>(stream));
    return st == cudaSuccess ? 0 : dflash2::cudaFail(err, errLen, "kernel launch", st);
}

extern "C" DF2_API int32_t dflash2_cuda_device_count(char* err, size_t errLen)
{
    int count = 0;
    cudaError_t const st = cudaGetDeviceCount(&count);
    if (st != cudaSuccess)
    {
        dflash2::cudaFail(err, errLen, "cudaGetDeviceCount", st);
        return -1;
    }
    return count;
}
