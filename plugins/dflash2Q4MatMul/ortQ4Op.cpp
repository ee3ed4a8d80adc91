// The ONNX Runtime custom-op library: op Q4MatMul in domain ai.dflash2, a drop-in for the MatMulNBits nodes
// dflash2-export writes (4 bits, block 32, accuracy level 4, no zero points / g_idx / bias): the same inputs
// (A [..., K] fp32, B uint8 [N, K/32, 16], scales fp32 [N, K/32] or [N * K/32]) and attributes (K, N, bits,
// block_size, accuracy_level), the kernel of q4Kernel.cpp, its rows split over ONNX Runtime's own intra-op pool.
// ORT loads it with SessionOptions.register_custom_ops_library (dflash2/native/q4.py); it calls nothing but the
// C API entries declared in ortAbi.h.
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "ortAbi.h"
#include "q4Kernel.h"

namespace {

const OrtApi* g_api = nullptr;

OrtStatus* fail(const char* fmt, long a = 0, long b = 0) {
  char msg[256];
  std::snprintf(msg, sizeof msg, fmt, a, b);
  return ortabi::CreateStatus(g_api)(ORT_INVALID_ARGUMENT, msg);
}

#define DF2_TRY(expr)              \
  do {                             \
    OrtStatus* st_ = (expr);       \
    if (st_ != nullptr) return st_; \
  } while (0)

struct Kernel {
  int64_t K = 0, N = 0;
};

struct Work {  // one call: what every ParallelFor batch reads
  const Kernel* k;
  int M;
  const float* A;
  const uint8_t* B;
  const float* S;
  void* scratch;
  float* Y;
  size_t tiles;
};

constexpr int kTile = 64;          // output columns a ParallelFor iteration computes
constexpr int kPrepareRows = 16;   // activation rows a ParallelFor iteration quantizes (from 2 x this many rows)

void prepareRows(void* user, size_t i) {
  const Work& w = *static_cast<const Work*>(user);
  const int m0 = static_cast<int>(i) * kPrepareRows, m1 = m0 + kPrepareRows < w.M ? m0 + kPrepareRows : w.M;
  df2q4::prepare(m0, m1, static_cast<int>(w.k->K), w.A, w.scratch);
}

void tile(void* user, size_t i) {
  const Work& w = *static_cast<const Work*>(user);
  const int n0 = static_cast<int>(i) * kTile;
  const int n1 = n0 + kTile < w.k->N ? n0 + kTile : static_cast<int>(w.k->N);
  df2q4::rows(w.M, static_cast<int>(w.k->K), static_cast<int>(w.k->N), n0, n1, w.B, w.S, w.scratch, w.Y);
}

int64_t attr(const OrtKernelInfo* info, const char* name, int64_t fallback, OrtStatus** err) {
  int64_t v = 0;
  OrtStatus* st = ortabi::KernelInfoGetAttribute_int64(g_api)(info, name, &v);
  if (st == nullptr) return v;
  ortabi::ReleaseStatus(g_api)(st);  // absent: the MatMulNBits default
  if (fallback < 0) *err = fail("Q4MatMul: attribute %s missing", 0, 0);
  return fallback;
}

OrtStatus* createKernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  if (!df2q4::supported())
    return ortabi::CreateStatus(g_api)(ORT_FAIL, "Q4MatMul: this CPU lacks AVX512-VNNI; run the MatMulNBits graph");
  OrtStatus* err = nullptr;
  Kernel k;
  k.K = attr(info, "K", -1, &err);
  k.N = attr(info, "N", -1, &err);
  const int64_t bits = attr(info, "bits", 4, &err), block = attr(info, "block_size", 32, &err);
  const int64_t acc = attr(info, "accuracy_level", 0, &err);
  if (err != nullptr) return err;
  if (bits != 4 || block != 32) return fail("Q4MatMul: bits 4 and block_size 32 expected, found %ld and %ld", bits, block);
  if (acc != 4) return fail("Q4MatMul: accuracy_level 4 (int8 activations) expected, found %ld", acc);
  if (k.K <= 0 || k.K % 32 != 0 || k.N <= 0) return fail("Q4MatMul: K a positive multiple of 32 and N > 0 expected, found %ld, %ld", k.K, k.N);
  *out = new (std::nothrow) Kernel(k);
  return *out ? nullptr : ortabi::CreateStatus(g_api)(ORT_FAIL, "Q4MatMul: out of memory");
}

OrtStatus* shapeOf(const OrtValue* v, std::vector<int64_t>* dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  DF2_TRY(ortabi::GetTensorTypeAndShape(g_api)(v, &info));
  size_t n = 0;
  OrtStatus* st = ortabi::GetDimensionsCount(g_api)(info, &n);
  if (st == nullptr) {
    dims->resize(n);
    st = ortabi::GetDimensions(g_api)(info, dims->data(), n);
  }
  ortabi::ReleaseTensorTypeAndShapeInfo(g_api)(info);
  return st;
}

OrtStatus* compute(void* self, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(self);
  const OrtValue *a = nullptr, *b = nullptr, *s = nullptr;
  DF2_TRY(ortabi::KernelContext_GetInput(g_api)(ctx, 0, &a));
  DF2_TRY(ortabi::KernelContext_GetInput(g_api)(ctx, 1, &b));
  DF2_TRY(ortabi::KernelContext_GetInput(g_api)(ctx, 2, &s));
  std::vector<int64_t> ad, bd, sd;
  DF2_TRY(shapeOf(a, &ad));
  DF2_TRY(shapeOf(b, &bd));
  DF2_TRY(shapeOf(s, &sd));
  if (ad.empty() || ad.back() != k.K) return fail("Q4MatMul: A's last dimension %ld, K is %ld", ad.empty() ? -1 : ad.back(), k.K);
  int64_t bn = 1, sn = 1, rows = 1;
  for (int64_t d : bd) bn *= d;
  for (int64_t d : sd) sn *= d;
  if (bn != k.N * k.K / 2 || sn != k.N * k.K / 32) return fail("Q4MatMul: B / scales hold %ld / %ld values, not N*K/2, N*K/32", bn, sn);
  for (size_t i = 0; i + 1 < ad.size(); ++i) rows *= ad[i];
  std::vector<int64_t> yd(ad);
  yd.back() = k.N;
  OrtValue* y = nullptr;
  DF2_TRY(ortabi::KernelContext_GetOutput(g_api)(ctx, 0, yd.data(), yd.size(), &y));
  if (rows == 0) return nullptr;
  void *ap = nullptr, *bp = nullptr, *sp = nullptr, *yp = nullptr;
  DF2_TRY(ortabi::GetTensorMutableData(g_api)(const_cast<OrtValue*>(a), &ap));
  DF2_TRY(ortabi::GetTensorMutableData(g_api)(const_cast<OrtValue*>(b), &bp));
  DF2_TRY(ortabi::GetTensorMutableData(g_api)(const_cast<OrtValue*>(s), &sp));
  DF2_TRY(ortabi::GetTensorMutableData(g_api)(y, &yp));
  // not zeroed: prepare writes every byte the kernel reads
  std::unique_ptr<unsigned char[]> scratch(new (std::nothrow) unsigned char[df2q4::scratchBytes(static_cast<int>(rows), static_cast<int>(k.K))]);
  if (!scratch) return ortabi::CreateStatus(g_api)(ORT_FAIL, "Q4MatMul: out of memory");
  Work w{&k, static_cast<int>(rows), static_cast<const float*>(ap), static_cast<const uint8_t*>(bp),
         static_cast<const float*>(sp), scratch.get(), static_cast<float*>(yp),
         static_cast<size_t>((k.N + kTile - 1) / kTile)};
  if (rows >= 2 * kPrepareRows)  // a prefill: quantizing its rows is worth the pool
    DF2_TRY(ortabi::KernelContext_ParallelFor(g_api)(ctx, prepareRows, static_cast<size_t>((rows + kPrepareRows - 1) / kPrepareRows), 0, &w));
  else
    df2q4::prepare(0, w.M, static_cast<int>(k.K), w.A, scratch.get());
  return ortabi::KernelContext_ParallelFor(g_api)(ctx, tile, w.tiles, 0, &w);
}

void destroy(void* self) { delete static_cast<Kernel*>(self); }

const char* name(const OrtCustomOp*) { return "Q4MatMul"; }
const char* provider(const OrtCustomOp*) { return nullptr; }  // the CPU provider
ONNXTensorElementDataType inputType(const OrtCustomOp*, size_t i) {
  return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t inputCount(const OrtCustomOp*) { return 3; }
ONNXTensorElementDataType outputType(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t outputCount(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType memType(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int one(const OrtCustomOp*) { return 1; }
int zero(const OrtCustomOp*) { return 0; }
int startVersion(const OrtCustomOp*) { return 1; }
int endVersion(const OrtCustomOp*) { return 2147483647; }

OrtCustomOp makeOp() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof op);
  op.version = ortabi::kCustomOpVersion;
  op.GetName = name;
  op.GetExecutionProviderType = provider;
  op.GetInputType = inputType;
  op.GetInputTypeCount = inputCount;
  op.GetOutputType = outputType;
  op.GetOutputTypeCount = outputCount;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = memType;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = zero;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = zero;
  op.CreateKernelV2 = createKernel;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = destroy;
  op.GetStartVersion = startVersion;
  op.GetEndVersion = endVersion;
  return op;
}

const OrtCustomOp g_op = makeOp();

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  g_api = base->GetApi(ortabi::kApiVersion);
  if (g_api == nullptr) return nullptr;  // an ONNX Runtime older than the API version this library needs
  OrtCustomOpDomain* domain = nullptr;
  DF2_TRY(ortabi::CreateCustomOpDomain(g_api)("ai.dflash2", &domain));
  DF2_TRY(ortabi::CustomOpDomain_Add(g_api)(domain, &g_op));
  return ortabi::AddCustomOpDomain(g_api)(options, domain);
}
