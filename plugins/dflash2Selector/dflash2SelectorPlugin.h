/*
 * DFlash2Selector TensorRT plugin (IPluginV3): fused codebook pair scoring + path walk (greedy or sampled).
 * The contract (inputs, outputs, attributes, limits) is dflash2/ops/contract.py, mirrored in
 * DFlash2Selector_PluginConfig.yaml; README.md beside this file describes the op.
 */
#ifndef DFLASH2_SELECTOR_PLUGIN_H
#define DFLASH2_SELECTOR_PLUGIN_H

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace dflash2
{

constexpr char const* kPLUGIN_NAME = "DFlash2Selector";
constexpr char const* kPLUGIN_VERSION = "3"; // 2: + confidence output; 3: + uniforms, temperature, draft_probs
constexpr char const* kPLUGIN_NAMESPACE = "";
// cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature
constexpr int32_t kNB_INPUTS = 8;
constexpr int32_t kNB_OUTPUTS = 5; // draft_ids, path_index, path_scores, confidence, draft_probs

//! Attribute values after validation (names, kinds and defaults as in the contract).
struct SelectorAttrs
{
    int32_t topK{0};
    int32_t rank{0};
    float outputMultiplier{1.0F};
    float logitSoftcap{0.0F};
    std::string mode{"greedy"};
};

//! Parses and validates PluginFields; throws std::invalid_argument naming the attribute.
SelectorAttrs parseAttributes(nvinfer1::PluginFieldCollection const* fc);

//! DF2_MODE_GREEDY / DF2_MODE_SAMPLE of a mode name, -1 for any other.
int32_t modeCode(std::string const& mode);

//! "" when the input shapes fit the contract and the attributes; unknown (-1) extents are skipped.
std::string shapeProblem(nvinfer1::Dims const* dims, int32_t nbInputs, SelectorAttrs const& attrs);

//! float32, float16 or bfloat16.
bool isFloatType(nvinfer1::DataType t);

//! "" when the input dtypes fit the contract.
std::string typeProblem(nvinfer1::DataType const* types, int32_t nbInputs);

//! Routes a message to the recorder if one is attached, else to TensorRT's logger, else stderr.
void reportError(nvinfer1::IErrorRecorder* recorder, std::string const& msg) noexcept;

class DFlash2SelectorPlugin final : public nvinfer1::IPluginV3,
                                    public nvinfer1::IPluginV3OneCore,
                                    public nvinfer1::IPluginV3OneBuild,
                                    public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit DFlash2SelectorPlugin(SelectorAttrs attrs);
    DFlash2SelectorPlugin(DFlash2SelectorPlugin const& other);
    DFlash2SelectorPlugin& operator=(DFlash2SelectorPlugin const&) = delete;
    ~DFlash2SelectorPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    SelectorAttrs const& attrs() const noexcept
    {
        return mAttrs;
    }

private:
    SelectorAttrs mAttrs;
    nvinfer1::IErrorRecorder* mRecorder{nullptr}; // owned by the execution context we are attached to
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class DFlash2SelectorPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    DFlash2SelectorPluginCreator();

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFieldNames;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace dflash2

#endif // DFLASH2_SELECTOR_PLUGIN_H
