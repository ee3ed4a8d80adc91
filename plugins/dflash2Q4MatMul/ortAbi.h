// The part of ONNX Runtime's C API this library uses, declared here because no package this project installs
// ships ORT's headers. The C API is a stable ABI: OrtApi is a table of function pointers that only ever grows at
// its end (ORT asserts every version's last slot in onnxruntime_c_api.cc), so an entry's position is fixed from
// the version that added it on; GetApi(kApiVersion) hands out that table on any ONNX Runtime >= 1.17.
// The positions and signatures below were read off ORT 1.20's header, checked with offsetof against it and 1.29's,
// and called through in ONNX Runtime 1.32 (tests/test_q4_matmul.py runs the op through ORT on every build).
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {
struct OrtApi;  // opaque: read only through ortabi::slot
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtCustomOpDomain;
struct OrtSessionOptions;
struct OrtShapeInferContext;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum ONNXTensorElementDataType { ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2 };
enum OrtCustomOpInputOutputCharacteristic { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1 };
enum OrtMemType { OrtMemTypeDefault = 0 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// A custom op as ORT reads it; ORT looks at the fields the declared `version` has (CreateKernelV2 /
// KernelComputeV2 from 16, the start / end opset from 17) and at no later ones.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
};
}  // extern "C"

namespace ortabi {

constexpr uint32_t kApiVersion = 17;       // KernelContext_ParallelFor's
constexpr uint32_t kCustomOpVersion = 17;  // the OrtCustomOp fields above, no later ones

template <typename F>
F slot(const OrtApi* api, size_t i) {
  return reinterpret_cast<F const*>(api)[i];
}

#define DF2_ORT_ENTRY(name, index, ret, ...)                                              \
  inline ret (*name(const OrtApi* api))(__VA_ARGS__) { return slot<ret (*)(__VA_ARGS__)>(api, index); }

DF2_ORT_ENTRY(CreateStatus, 0, OrtStatus*, OrtErrorCode, const char*)
DF2_ORT_ENTRY(GetErrorMessage, 2, const char*, const OrtStatus*)
DF2_ORT_ENTRY(CreateCustomOpDomain, 26, OrtStatus*, const char*, OrtCustomOpDomain**)
DF2_ORT_ENTRY(CustomOpDomain_Add, 27, OrtStatus*, OrtCustomOpDomain*, const OrtCustomOp*)
DF2_ORT_ENTRY(AddCustomOpDomain, 28, OrtStatus*, OrtSessionOptions*, OrtCustomOpDomain*)
DF2_ORT_ENTRY(GetTensorMutableData, 51, OrtStatus*, OrtValue*, void**)
DF2_ORT_ENTRY(GetDimensionsCount, 61, OrtStatus*, const OrtTensorTypeAndShapeInfo*, size_t*)
DF2_ORT_ENTRY(GetDimensions, 62, OrtStatus*, const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)
DF2_ORT_ENTRY(GetTensorTypeAndShape, 65, OrtStatus*, const OrtValue*, OrtTensorTypeAndShapeInfo**)
DF2_ORT_ENTRY(KernelInfoGetAttribute_int64, 86, OrtStatus*, const OrtKernelInfo*, const char*, int64_t*)
DF2_ORT_ENTRY(KernelContext_GetInput, 90, OrtStatus*, const OrtKernelContext*, size_t, const OrtValue**)
DF2_ORT_ENTRY(KernelContext_GetOutput, 91, OrtStatus*, OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)
DF2_ORT_ENTRY(ReleaseStatus, 93, void, OrtStatus*)
DF2_ORT_ENTRY(ReleaseTensorTypeAndShapeInfo, 99, void, OrtTensorTypeAndShapeInfo*)
DF2_ORT_ENTRY(KernelContext_ParallelFor, 274, OrtStatus*, const OrtKernelContext*, void (*)(void*, size_t), size_t,
              size_t, void*)

#undef DF2_ORT_ENTRY

}  // namespace ortabi
