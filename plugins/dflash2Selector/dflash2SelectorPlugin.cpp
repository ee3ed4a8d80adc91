/*
 * DFlash2Selector TensorRT plugin: attribute parsing, shape/type rules, lifecycle, enqueue.
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

char const* const kInputNames[kNB_INPUTS]
    = {"cand_logits", "cand_ids", "gate", "anchor", "pred_codebook", "succ_codebook"};
char const* const kOutputNames[kNB_OUTPUTS] = {"draft_ids", "path_index", "path_scores"};
// Symbolic dims of each input, as in the contract: B S K / B S K / B S R / B / V R / V R.
char const* const kInputDims[kNB_INPUTS] = {"BSK", "BSK", "BSR", "B", "VR", "VR"};

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

char const* typeName(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    case DataType::kBOOL: return "bool";
    default: return "other";
    }
}

bool isFloatType(DataType t)
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

int32_t dtypeCode(DataType t)
{
    return t == DataType::kFLOAT ? DF2_FLOAT32 : t == DataType::kHALF ? DF2_FLOAT16 : DF2_BFLOAT16;
}

char const* fieldTypeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kINT32: return "INT32";
    case PluginFieldType::kINT64: return "INT64";
    case PluginFieldType::kFLOAT32: return "FLOAT32";
    case PluginFieldType::kFLOAT64: return "FLOAT64";
    case PluginFieldType::kCHAR: return "CHAR";
    default: return "another type";
    }
}

std::string quoted(std::string const& s)
{
    return "'" + s + "'";
}

int64_t readInt(PluginField const& f)
{
    if (f.data == nullptr || f.length != 1)
        fail("attribute " + quoted(f.name) + " expected 1 value, found " + std::to_string(f.length));
    if (f.type == PluginFieldType::kINT32)
        return *static_cast<int32_t const*>(f.data);
    if (f.type == PluginFieldType::kINT64)
        return *static_cast<int64_t const*>(f.data);
    fail("attribute " + quoted(f.name) + " expected an INT32 field, found " + fieldTypeName(f.type));
}

float readFloat(PluginField const& f)
{
    if (f.data == nullptr || f.length != 1)
        fail("attribute " + quoted(f.name) + " expected 1 value, found " + std::to_string(f.length));
    if (f.type == PluginFieldType::kFLOAT32)
        return *static_cast<float const*>(f.data);
    if (f.type == PluginFieldType::kFLOAT64)
        return static_cast<float>(*static_cast<double const*>(f.data));
    fail("attribute " + quoted(f.name) + " expected a FLOAT32 field, found " + fieldTypeName(f.type));
}

std::string readString(PluginField const& f)
{
    if (f.type != PluginFieldType::kCHAR)
        fail("attribute " + quoted(f.name) + " expected a CHAR field, found " + fieldTypeName(f.type));
    if (f.length < 0 || (f.length > 0 && f.data == nullptr))
        fail("attribute " + quoted(f.name) + " has no data (length " + std::to_string(f.length) + ")");
    std::string s(static_cast<char const*>(f.data), static_cast<size_t>(f.length));
    return s.substr(0, s.find('\0')); // the ONNX parser passes no NUL, serialized fields carry one
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

SelectorAttrs parseAttributes(PluginFieldCollection const* fc)
{
    static char const* const known[] = {"top_k", "rank", "output_multiplier", "logit_softcap", "mode"};
    SelectorAttrs a;
    bool seen[5] = {};
    int32_t const n = fc == nullptr ? 0 : fc->nbFields;
    for (int32_t i = 0; i < n; ++i)
    {
        PluginField const& f = fc->fields[i];
        if (f.name == nullptr)
            fail("field #" + std::to_string(i) + " has no name");
        int k = 0;
        while (k < 5 && std::strcmp(f.name, known[k]) != 0)
            ++k;
        if (k == 5)
            fail("unknown attribute " + quoted(f.name)
                + "; expected a subset of top_k, rank, output_multiplier, logit_softcap, mode");
        if (seen[k])
            fail("attribute " + quoted(f.name) + " given twice");
        seen[k] = true;
        if (k < 2)
        {
            int64_t const v = readInt(f);
            int64_t const hi = k == 0 ? DF2_MAX_TOP_K : DF2_MAX_RANK;
            if (v < 1 || v > hi)
                fail("attribute " + quoted(f.name) + " expected 1.." + std::to_string(hi) + ", found "
                    + std::to_string(v));
            (k == 0 ? a.topK : a.rank) = static_cast<int32_t>(v);
        }
        else if (k < 4)
            (k == 2 ? a.outputMultiplier : a.logitSoftcap) = readFloat(f);
        else
            a.mode = readString(f);
    }
    for (int k = 0; k < 2; ++k)
        if (!seen[k])
            fail("required attribute " + quoted(known[k]) + " is missing");
    if (!(a.outputMultiplier > 0.0F))
        fail("attribute 'output_multiplier' expected > 0, found " + std::to_string(a.outputMultiplier));
    if (!(a.logitSoftcap >= 0.0F))
        fail("attribute 'logit_softcap' expected >= 0, found " + std::to_string(a.logitSoftcap));
    if (a.mode != "greedy")
        fail("attribute 'mode' expected one of ['greedy'], found " + quoted(a.mode));
    return a;
}

std::string shapeProblem(Dims const* dims, int32_t nbInputs, SelectorAttrs const& attrs)
{
    if (nbInputs != kNB_INPUTS)
        return "expected " + std::to_string(kNB_INPUTS) + " inputs, found " + std::to_string(nbInputs);
    int64_t sym[128];
    std::fill(sym, sym + 128, int64_t{-1});
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        std::string const names = kInputDims[i];
        if (dims[i].nbDims != static_cast<int32_t>(names.size()))
            return std::string("input ") + kInputNames[i] + " expected rank " + std::to_string(names.size()) + " ["
                + names + "], found rank " + std::to_string(dims[i].nbDims);
        for (size_t j = 0; j < names.size(); ++j)
        {
            int64_t const n = dims[i].d[j];
            int64_t& want = sym[static_cast<unsigned char>(names[j])];
            if (n < 0)
                continue;
            if (want >= 0 && want != n)
                return std::string("dim ") + names[j] + " of input " + kInputNames[i] + " expected "
                    + std::to_string(want) + ", found " + std::to_string(n);
            want = n;
        }
    }
    if (sym['K'] >= 0 && sym['K'] != attrs.topK)
        return "K of the inputs expected top_k=" + std::to_string(attrs.topK) + ", found " + std::to_string(sym['K']);
    if (sym['R'] >= 0 && sym['R'] != attrs.rank)
        return "R of the inputs expected rank=" + std::to_string(attrs.rank) + ", found " + std::to_string(sym['R']);
    if (sym['V'] == 0)
        return "V (codebook rows) expected >= 1, found 0";
    return "";
}

std::string typeProblem(DataType const* t, int32_t nbInputs)
{
    if (nbInputs != kNB_INPUTS)
        return "expected " + std::to_string(kNB_INPUTS) + " inputs, found " + std::to_string(nbInputs);
    if (!isFloatType(t[0]))
        return std::string("input cand_logits dtype expected one of float32, float16, bfloat16, found ")
            + typeName(t[0]);
    for (int32_t i : {1, 3})
        if (t[i] != DataType::kINT32)
            return std::string("input ") + kInputNames[i] + " dtype expected int32, found " + typeName(t[i]);
    if (!isFloatType(t[2]))
        return std::string("input gate dtype expected one of float32, float16, bfloat16, found ") + typeName(t[2]);
    if (t[4] != t[2] || t[5] != t[2])
        return std::string("gate, pred_codebook and succ_codebook must share a dtype, found ") + typeName(t[2])
            + ", " + typeName(t[4]) + ", " + typeName(t[5]);
    return "";
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
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
            fail("expected 6 inputs / 3 outputs, found " + std::to_string(nbInputs) + " / " + std::to_string(nbOutputs));
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
            fail("expected 3 outputs, found " + std::to_string(nbOutputs));
        std::string const problem = typeProblem(inputTypes, nbInputs);
        if (!problem.empty())
            fail(problem);
        outputTypes[0] = DataType::kINT32;
        outputTypes[1] = DataType::kINT32;
        outputTypes[2] = DataType::kFLOAT;
        return 0;
    });
}

int32_t DFlash2SelectorPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    return guarded<int32_t>(mRecorder, "getOutputShapes", -1, [&] {
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
            fail("expected 6 inputs / 3 outputs, found " + std::to_string(nbInputs) + " / " + std::to_string(nbOutputs));
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
            outputs[o].nbDims = o < 2 ? 2 : 3; // [B, S] / [B, S] / [B, S, K]
            outputs[o].d[0] = inputs[0].d[0];
            outputs[o].d[1] = inputs[0].d[1];
        }
        outputs[2].d[2] = k;
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
        case 8: return d.type == DataType::kFLOAT; // path_scores
        default: return d.type == DataType::kINT32; // cand_ids, anchor, draft_ids, path_index
        }
    });
}

int32_t DFlash2SelectorPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    return guarded<int32_t>(mRecorder, "onShapeChange", -1, [&] {
        if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
            fail("expected 6 inputs / 3 outputs, found " + std::to_string(nbInputs) + " / " + std::to_string(nbOutputs));
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
        a.draft_ids = static_cast<int32_t*>(outputs[0]);
        a.path_index = static_cast<int32_t*>(outputs[1]);
        a.path_scores = static_cast<float*>(outputs[2]);
        a.B = inputDesc[0].dims.d[0];
        a.S = inputDesc[0].dims.d[1];
        a.K = inputDesc[0].dims.d[2];
        a.R = inputDesc[2].dims.d[2];
        a.V = inputDesc[4].dims.d[0];
        a.logits_dtype = dtypeCode(inputDesc[0].type);
        a.codebook_dtype = dtypeCode(inputDesc[2].type);
        a.output_multiplier = mAttrs.outputMultiplier;
        a.logit_softcap = mAttrs.logitSoftcap;
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
