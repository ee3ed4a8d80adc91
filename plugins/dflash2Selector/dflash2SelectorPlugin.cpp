/*
 * DFlash2Selector TensorRT plugin: lifecycle, serialization, enqueue, creator, library entry points.
 * Attribute parsing and the shape / dtype rules: dflash2SelectorRules.cpp.
 * Every noexcept method runs its body through guarded(): exceptions become a reported error
 * and an error return value, never an escape.
 */
#include "dflash2SelectorPlugin.h"

#include "dflash2SelectorCpu.h"
#include "dflash2SelectorKernel.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>

using namespace nvinfer1;

namespace dflash2
{
namespace
{

std::atomic<ILoggerFinder*> gLoggerFinder{nullptr};

template <typename T, typename F>
T guarded(IErrorRecorder* recorder, char const* where, T onError, F&& body) noexcept
{
    try
    {
        return body();
    }
    catch (std::exception const& e)
    {
        reportError(recorder, std::string(kPLUGIN_NAME) + "::" + where + ": " + e.what());
    }
    catch (...)
    {
        reportError(recorder, std::string(kPLUGIN_NAME) + "::" + where + ": unknown exception");
    }
    return onError;
}

[[noreturn]] void fail(std::string const& msg)
{
    throw std::invalid_argument(msg);
}

void checkCounts(int32_t nbInputs, int32_t nbOutputs)
{
    if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        fail("expected " + std::to_string(kNB_INPUTS) + " inputs / " + std::to_string(kNB_OUTPUTS) + " outputs, found "
            + std::to_string(nbInputs) + " / " + std::to_string(nbOutputs));
}

int32_t dtypeCode(DataType t)
{
    return t == DataType::kFLOAT ? DF2_FLOAT32 : t == DataType::kHALF ? DF2_FLOAT16 : DF2_BFLOAT16;
}

} // namespace

void reportError(IErrorRecorder* recorder, std::string const& msg) noexcept
{
    try
    {
        if (recorder != nullptr)
        {
            recorder->reportError(ErrorCode::kINVALID_ARGUMENT, msg.c_str());
            return;
        }
        ILoggerFinder* finder = gLoggerFinder.load();
        ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
        if (logger != nullptr)
        {
            logger->log(ILogger::Severity::kERROR, msg.c_str());
            return;
        }
    }
    catch (...)
    {
        // fall through to stderr: a failing logger must not take the process down
    }
    std::fprintf(stderr, "[E] %s\n", msg.c_str());
}

// ---------------------------------------------------------------------------------------- plugin

DFlash2SelectorPlugin::DFlash2SelectorPlugin(SelectorAttrs attrs)
    : mAttrs(std::move(attrs))
{
}

DFlash2SelectorPlugin::DFlash2SelectorPlugin(DFlash2SelectorPlugin const& other)
    : IPluginV3(other)
    , IPluginV3OneCore(other)
    , IPluginV3OneBuild(other)
    , IPluginV3OneRuntime(other)
    , mAttrs(other.mAttrs)
    , mRecorder(other.mRecorder)
{
    // mFields point into the source object's members: rebuilt on demand, never copied.
}

IPluginCapability* DFlash2SelectorPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    return guarded<IPluginCapability*>(mRecorder, "getCapabilityInterface", nullptr, [&]() -> IPluginCapability* {
        switch (type)
        {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        fail("unknown capability type " + std::to_string(static_cast<int32_t>(type)));
    });
}

IPluginV3* DFlash2SelectorPlugin::clone() noexcept
{
    return guarded<IPluginV3*>(mRecorder, "clone", nullptr, [&] { return new DFlash2SelectorPlugin(*this); });
}

char const* DFlash2SelectorPlugin::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* DFlash2SelectorPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* DFlash2SelectorPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t DFlash2SelectorPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t DFlash2SelectorPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    return guarded<int32_t>(mRecorder, "configurePlugin", -1, [&] {
        checkCounts(nbInputs, nbOutputs);
        Dims dims[kNB_INPUTS];
        DataType types[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            dims[i] = in[i].desc.dims;
            types[i] = in[i].desc.type;
        }
        std::string problem = shapeProblem(dims, nbInputs, mAttrs);
        if (problem.empty())
            problem = typeProblem(types, nbInputs);
        if (!problem.empty())
            fail(problem);
        return 0;
    });
}

int32_t DFlash2SelectorPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    return guarded<int32_t>(mRecorder, "getOutputDataTypes", -1, [&] {
        if (nbOutputs != kNB_OUTPUTS)
            fail("expected " + std::to_string(kNB_OUTPUTS) + " outputs, found " + std::to_string(nbOutputs));
        std::string const problem = typeProblem(inputTypes, nbInputs);
        if (!problem.empty())
            fail(problem);
        outputTypes[0] = DataType::kINT32;
        outputTypes[1] = DataType::kINT32;
        outputTypes[2] = DataType::kFLOAT;
        outputTypes[3] = DataType::kFLOAT;
        outputTypes[4] = DataType::kFLOAT;
        return 0;
    });
}

int32_t DFlash2SelectorPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    return guarded<int32_t>(mRecorder, "getOutputShapes", -1, [&] {
        checkCounts(nbInputs, nbOutputs);
        // Build-time extents: constants where known, -1 otherwise, checked like runtime shapes.
        Dims dims[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            dims[i].nbDims = inputs[i].nbDims;
            for (int32_t j = 0; j < inputs[i].nbDims && j < Dims::MAX_DIMS; ++j)
                dims[i].d[j] = inputs[i].d[j]->isConstant() ? inputs[i].d[j]->getConstantValue() : -1;
        }
        std::string const problem = shapeProblem(dims, nbInputs, mAttrs);
        if (!problem.empty())
            fail(problem);
        IDimensionExpr const* k = exprBuilder.constant(mAttrs.topK);
        for (int32_t o = 0; o < kNB_OUTPUTS; ++o)
        {
            bool const perCandidate = o == 2 || o == 4; // path_scores, draft_probs: [B, S, K]; others [B, S]
            outputs[o].nbDims = perCandidate ? 3 : 2;
            outputs[o].d[0] = inputs[0].d[0];
            outputs[o].d[1] = inputs[0].d[1];
            if (perCandidate)
                outputs[o].d[2] = k;
        }
        return 0;
    });
}

bool DFlash2SelectorPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    return guarded<bool>(mRecorder, "supportsFormatCombination", false, [&] {
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0 || pos >= kNB_INPUTS + kNB_OUTPUTS)
            fail("position " + std::to_string(pos) + " out of range for " + std::to_string(nbInputs) + " inputs / "
                + std::to_string(nbOutputs) + " outputs");
        PluginTensorDesc const& d = inOut[pos].desc;
        if (d.format != TensorFormat::kLINEAR)
            return false;
        switch (pos)
        {
        case 0: // cand_logits: any float type of its own
        case 2: // gate: the float type the codebooks share
            return isFloatType(d.type);
        case 4:
        case 5: return d.type == inOut[2].desc.type;
        case 6:  // uniforms
        case 7:  // temperature
        case 10: // path_scores
        case 11: // confidence
        case 12: return d.type == DataType::kFLOAT; // draft_probs
        default: return d.type == DataType::kINT32; // cand_ids, anchor, draft_ids, path_index
        }
    });
}

int32_t DFlash2SelectorPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    return guarded<int32_t>(mRecorder, "onShapeChange", -1, [&] {
        checkCounts(nbInputs, nbOutputs);
        Dims dims[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
            dims[i] = in[i].dims;
        std::string const problem = shapeProblem(dims, nbInputs, mAttrs);
        if (!problem.empty())
            fail(problem);
        return 0;
    });
}

int32_t DFlash2SelectorPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    return guarded<int32_t>(mRecorder, "enqueue", -1, [&] {
        Dims dims[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
            dims[i] = inputDesc[i].dims;
        std::string const problem = shapeProblem(dims, kNB_INPUTS, mAttrs);
        if (!problem.empty())
            fail(problem);
        Df2SelectArgs a{};
        a.cand_logits = inputs[0];
        a.cand_ids = static_cast<int32_t const*>(inputs[1]);
        a.gate = inputs[2];
        a.anchor = static_cast<int32_t const*>(inputs[3]);
        a.pred_codebook = inputs[4];
        a.succ_codebook = inputs[5];
        a.uniforms = static_cast<float const*>(inputs[6]);
        a.temperature = static_cast<float const*>(inputs[7]);
        a.draft_ids = static_cast<int32_t*>(outputs[0]);
        a.path_index = static_cast<int32_t*>(outputs[1]);
        a.path_scores = static_cast<float*>(outputs[2]);
        a.confidence = static_cast<float*>(outputs[3]);
        a.draft_probs = static_cast<float*>(outputs[4]);
        a.B = inputDesc[0].dims.d[0];
        a.S = inputDesc[0].dims.d[1];
        a.K = inputDesc[0].dims.d[2];
        a.R = inputDesc[2].dims.d[2];
        a.V = inputDesc[4].dims.d[0];
        a.logits_dtype = dtypeCode(inputDesc[0].type);
        a.codebook_dtype = dtypeCode(inputDesc[2].type);
        a.output_multiplier = mAttrs.outputMultiplier;
        a.logit_softcap = mAttrs.logitSoftcap;
        a.mode = modeCode(mAttrs.mode); // validated by parseAttributes; check_select_args rejects -1 anyway
        char err[256] = {};
        if (dflash2_check_select_args(&a, err, sizeof err) != 0)
            fail(err);
        cudaError_t const status = launchSelectPath(a, stream);
        if (status != cudaSuccess)
            fail(std::string("kernel launch failed: ") + cudaGetErrorString(status));
        return 0;
    });
}

IPluginV3* DFlash2SelectorPlugin::attachToContext(IPluginResourceContext* context) noexcept
{
    return guarded<IPluginV3*>(mRecorder, "attachToContext", nullptr, [&] {
        auto* p = new DFlash2SelectorPlugin(*this);
        p->mRecorder = context != nullptr ? context->getErrorRecorder() : nullptr;
        return p;
    });
}

PluginFieldCollection const* DFlash2SelectorPlugin::getFieldsToSerialize() noexcept
{
    return guarded<PluginFieldCollection const*>(mRecorder, "getFieldsToSerialize", nullptr, [&] {
        mFields = {PluginField("top_k", &mAttrs.topK, PluginFieldType::kINT32, 1),
            PluginField("rank", &mAttrs.rank, PluginFieldType::kINT32, 1),
            PluginField("output_multiplier", &mAttrs.outputMultiplier, PluginFieldType::kFLOAT32, 1),
            PluginField("logit_softcap", &mAttrs.logitSoftcap, PluginFieldType::kFLOAT32, 1),
            PluginField("mode", mAttrs.mode.c_str(), PluginFieldType::kCHAR,
                static_cast<int32_t>(mAttrs.mode.size() + 1))};
        mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
        mFieldCollection.fields = mFields.data();
        return &mFieldCollection;
    });
}

// --------------------------------------------------------------------------------------- creator

DFlash2SelectorPluginCreator::DFlash2SelectorPluginCreator()
    : mFieldNames{PluginField("top_k", nullptr, PluginFieldType::kINT32, 1),
        PluginField("rank", nullptr, PluginFieldType::kINT32, 1),
        PluginField("output_multiplier", nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField("logit_softcap", nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField("mode", nullptr, PluginFieldType::kCHAR, 0)}
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
    mFieldCollection.fields = mFieldNames.data();
}

IPluginV3* DFlash2SelectorPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    // Build and runtime phases take the same fields: getFieldsToSerialize writes them all.
    return guarded<IPluginV3*>(
        nullptr, "createPlugin", nullptr, [&] { return new DFlash2SelectorPlugin(parseAttributes(fc)); });
}

PluginFieldCollection const* DFlash2SelectorPluginCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* DFlash2SelectorPluginCreator::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* DFlash2SelectorPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* DFlash2SelectorPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

} // namespace dflash2

// ------------------------------------------------------------- library entry points (loadLibrary)

extern "C" DF2_API void setLoggerFinder(ILoggerFinder* finder)
{
    dflash2::gLoggerFinder.store(finder);
}

extern "C" DF2_API IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    nbCreators = 0;
    return dflash2::guarded<IPluginCreatorInterface* const*>(nullptr, "getCreators", nullptr, [&] {
        static dflash2::DFlash2SelectorPluginCreator creator;
        static IPluginCreatorInterface* const creators[] = {&creator};
        nbCreators = 1;
        return creators;
    });
}
