/*
 * DFlash2Selector plugin lifecycle test: dlopens libdflash2_plugins.so the way
 * IPluginRegistry::loadLibrary does (getCreators, setLoggerFinder) and drives the IPluginV3 API
 * with hand-made TensorRT objects. Needs neither libnvinfer nor a GPU.
 *   dflash2_plugin_lifecycle_test [path/to/libdflash2_plugins.so]        run the checks
 *   dflash2_plugin_lifecycle_test --dump-fields [lib]                    print the field list as JSON
 * Exit status 0 when every check passes.
 */
#include <NvInferRuntime.h>

#include "dflash2SelectorMath.h" // Df2SelectArgs, the C ABI of the CPU twin

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

int gFailures = 0;
int gChecks = 0;

void check(bool ok, std::string const& what)
{
    ++gChecks;
    if (!ok)
    {
        ++gFailures;
        std::printf("FAIL: %s\n", what.c_str());
    }
}

// ---- TensorRT objects a real builder/runtime would hand the plugin --------------------------

struct CaptureLogger : public ILogger, public ILoggerFinder
{
    std::vector<std::string> errors;
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
            errors.emplace_back(msg);
    }
    ILogger* findLogger() override
    {
        return this;
    }
    std::string take()
    {
        std::string all;
        for (auto const& e : errors)
            all += e + "\n";
        errors.clear();
        return all;
    }
};

struct Recorder : public IErrorRecorder
{
    std::vector<std::string> descs;
    int32_t getNbErrors() const noexcept override
    {
        return static_cast<int32_t>(descs.size());
    }
    ErrorCode getErrorCode(int32_t) const noexcept override
    {
        return ErrorCode::kINVALID_ARGUMENT;
    }
    ErrorDesc getErrorDesc(int32_t i) const noexcept override
    {
        return descs[static_cast<size_t>(i)].c_str();
    }
    bool hasOverflowed() const noexcept override
    {
        return false;
    }
    void clear() noexcept override
    {
        descs.clear();
    }
    bool reportError(ErrorCode, ErrorDesc desc) noexcept override
    {
        descs.emplace_back(desc);
        return true;
    }
    RefCount incRefCount() noexcept override
    {
        return 1;
    }
    RefCount decRefCount() noexcept override
    {
        return 0;
    }
};

struct ResourceContext : public IPluginResourceContext
{
    IErrorRecorder* recorder{};
    IGpuAllocator* getGpuAllocator() const noexcept override
    {
        return nullptr;
    }
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return recorder;
    }
};

class DimImpl : public apiv::VDimensionExpr
{
public:
    DimImpl(int64_t v, bool c)
        : mValue(v)
        , mConst(c)
    {
    }
    bool isConstant() const override
    {
        return mConst;
    }
    int64_t getConstantValue() const override
    {
        return mConst ? mValue : -1;
    }
    bool isSizeTensor() const override
    {
        return false;
    }

private:
    int64_t mValue;
    bool mConst;
};

class Dim : public IDimensionExpr
{
public:
    Dim(int64_t v, bool c)
        : mFake(v, c)
    {
        mImpl = &mFake;
    }
    ~Dim() noexcept override = default;

private:
    DimImpl mFake;
};

class ExprImpl : public apiv::VExprBuilder
{
public:
    std::deque<std::unique_ptr<Dim>> made;
    IDimensionExpr const* constant(int64_t value) override
    {
        made.push_back(std::make_unique<Dim>(value, true));
        return made.back().get();
    }
    IDimensionExpr const* operation(DimensionOperation, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;
    }
};

class ExprBuilder : public IExprBuilder
{
public:
    explicit ExprBuilder(apiv::VExprBuilder* impl)
    {
        mImpl = impl;
    }
    ~ExprBuilder() noexcept override = default;
};

// ---- helpers ---------------------------------------------------------------------------------

struct Fields // PluginFields built from owned values; pointers made fresh by fc()
{
    struct Entry
    {
        char const* name;
        PluginFieldType type;
        int32_t i;
        float f;
        std::string s;
    };
    std::vector<Entry> entries;
    std::vector<PluginField> list;
    Fields& i(char const* n, int32_t v)
    {
        entries.push_back({n, PluginFieldType::kINT32, v, 0.0F, ""});
        return *this;
    }
    Fields& f(char const* n, float v)
    {
        entries.push_back({n, PluginFieldType::kFLOAT32, 0, v, ""});
        return *this;
    }
    Fields& s(char const* n, std::string const& v) // no NUL, as TensorRT's ONNX parser passes STRING
    {
        entries.push_back({n, PluginFieldType::kCHAR, 0, 0.0F, v});
        return *this;
    }
    PluginFieldCollection fc()
    {
        list.clear();
        for (Entry const& e : entries)
        {
            void const* data = e.type == PluginFieldType::kINT32 ? static_cast<void const*>(&e.i)
                : e.type == PluginFieldType::kFLOAT32           ? static_cast<void const*>(&e.f)
                                                                : static_cast<void const*>(e.s.data());
            int32_t const length = e.type == PluginFieldType::kCHAR ? static_cast<int32_t>(e.s.size()) : 1;
            list.emplace_back(e.name, data, e.type, length);
        }
        return PluginFieldCollection{static_cast<int32_t>(list.size()), list.data()};
    }
};

Fields goodFields()
{
    Fields f;
    f.i("top_k", 16).i("rank", 256).f("output_multiplier", 1.5F).f("logit_softcap", 30.0F).s("mode", "greedy");
    return f;
}

char const* fieldType(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kINT32: return "INT32";
    case PluginFieldType::kFLOAT32: return "FLOAT32";
    case PluginFieldType::kCHAR: return "CHAR";
    default: return "OTHER";
    }
}

std::string fieldValue(PluginField const& f)
{
    char buf[64];
    if (f.type == PluginFieldType::kINT32)
        std::snprintf(buf, sizeof buf, "%d", *static_cast<int32_t const*>(f.data));
    else if (f.type == PluginFieldType::kFLOAT32)
        std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(*static_cast<float const*>(f.data)));
    else if (f.type == PluginFieldType::kCHAR)
    {
        std::string s(static_cast<char const*>(f.data), static_cast<size_t>(f.length));
        return "\"" + s.substr(0, s.find('\0')) + "\"";
    }
    else
        return "null";
    return buf;
}

std::string serialized(IPluginV3* p)
{
    auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* fc = rt->getFieldsToSerialize();
    std::string out;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        out += std::string(fc->fields[i].name) + "=" + fieldValue(fc->fields[i]) + ";";
    return out;
}

constexpr int kIn = 8;   // cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature
constexpr int kOut = 5;  // draft_ids, path_index, path_scores, confidence, draft_probs
constexpr int kAll = kIn + kOut;

struct Io // a full set of tensor descriptions for the 8 inputs + 5 outputs
{
    DynamicPluginTensorDesc d[kAll]{};
    Io(int64_t B, int64_t S, int64_t K, int64_t R, int64_t V, DataType tl = DataType::kHALF,
        DataType tc = DataType::kBF16)
    {
        std::vector<std::vector<int64_t>> shapes = {{B, S, K}, {B, S, K}, {B, S, R}, {B}, {V, R}, {V, R}, {B, S}, {B},
            {B, S}, {B, S}, {B, S, K}, {B, S}, {B, S, K}};
        DataType types[kAll] = {tl, DataType::kINT32, tc, DataType::kINT32, tc, tc, DataType::kFLOAT, DataType::kFLOAT,
            DataType::kINT32, DataType::kINT32, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
        for (int i = 0; i < kAll; ++i)
        {
            d[i].desc.dims.nbDims = static_cast<int32_t>(shapes[i].size());
            for (size_t j = 0; j < shapes[i].size(); ++j)
                d[i].desc.dims.d[j] = shapes[i][j];
            d[i].desc.type = types[i];
            d[i].desc.format = TensorFormat::kLINEAR;
            d[i].min = d[i].max = d[i].opt = d[i].desc.dims;
        }
    }
    std::vector<PluginTensorDesc> plain() const
    {
        std::vector<PluginTensorDesc> v;
        for (auto const& x : d)
            v.push_back(x.desc);
        return v;
    }
};

bool contains(std::string const& hay, std::string const& needle)
{
    return hay.find(needle) != std::string::npos;
}

} // namespace

int main(int argc, char** argv)
{
    bool dump = argc > 1 && std::strcmp(argv[1], "--dump-fields") == 0;
    char const* lib = argc > (dump ? 2 : 1) ? argv[dump ? 2 : 1] : DF2_DEFAULT_PLUGIN_LIB;
    void* handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
    {
        std::printf("FAIL: dlopen(%s): %s\n", lib, dlerror());
        return 2;
    }
    using GetCreators = IPluginCreatorInterface* const* (*) (int32_t&);
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(handle, "setLoggerFinder"));
    if (getCreators == nullptr || setLoggerFinder == nullptr)
    {
        std::printf("FAIL: %s does not export getCreators and setLoggerFinder\n", lib);
        return 2;
    }
    CaptureLogger logger;
    setLoggerFinder(&logger);

    int32_t nb = 0;
    IPluginCreatorInterface* const* creators = getCreators(nb);
    if (nb != 1 || creators == nullptr || std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
    {
        std::printf("FAIL: expected one IPluginCreatorV3One, found %d creator(s)\n", nb);
        return 2;
    }
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);

    if (dump)
    {
        PluginFieldCollection const* names = creator->getFieldNames();
        std::printf("{\"name\": \"%s\", \"version\": \"%s\", \"namespace\": \"%s\", \"fields\": [",
            creator->getPluginName(), creator->getPluginVersion(), creator->getPluginNamespace());
        for (int32_t i = 0; i < names->nbFields; ++i)
            std::printf("%s{\"name\": \"%s\", \"type\": \"%s\"}", i ? ", " : "", names->fields[i].name,
                fieldType(names->fields[i].type));
        Fields req;
        req.i("top_k", 16).i("rank", 256);
        PluginFieldCollection fc = req.fc();
        IPluginV3* p = creator->createPlugin("dump", &fc, TensorRTPhase::kBUILD);
        auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* ser = rt->getFieldsToSerialize();
        std::printf("], \"serialized_defaults\": {");
        for (int32_t i = 0; i < ser->nbFields; ++i)
            std::printf("%s\"%s\": %s", i ? ", " : "", ser->fields[i].name, fieldValue(ser->fields[i]).c_str());
        auto* bld = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
        std::printf("}, \"nb_outputs\": %d, \"modes_accepted\": [", bld->getNbOutputs());
        // which of these mode names createPlugin takes (the test compares with contract.MODES)
        int shown = 0;
        for (char const* mode : {"greedy", "sample", "beam", "top_p", "Greedy", ""})
        {
            Fields m;
            m.i("top_k", 16).i("rank", 256).s("mode", mode);
            PluginFieldCollection mfc = m.fc();
            IPluginV3* mp = creator->createPlugin("dump", &mfc, TensorRTPhase::kBUILD);
            if (mp != nullptr)
                std::printf("%s\"%s\"", shown++ ? ", " : "", mode);
            delete mp;
        }
        std::printf("]}\n");
        delete p;
        return 0;
    }

    // -- creator identity ------------------------------------------------------------------------
    check(std::strcmp(creator->getPluginName(), "DFlash2Selector") == 0, "creator name");
    check(std::strcmp(creator->getPluginVersion(), "3") == 0, "creator version");
    check(std::strcmp(creator->getPluginNamespace(), "") == 0, "creator namespace");

    // -- a good plugin ---------------------------------------------------------------------------
    Fields good = goodFields();
    PluginFieldCollection goodFc = good.fc();
    IPluginV3* plugin = creator->createPlugin("selector", &goodFc, TensorRTPhase::kBUILD);
    check(plugin != nullptr, "createPlugin with good fields: " + logger.take());
    if (plugin == nullptr)
        return 1;
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(core && build && runtime, "all three capability interfaces");
    check(plugin->getCapabilityInterface(static_cast<PluginCapabilityType>(7)) == nullptr
            && contains(logger.take(), "unknown capability type 7"),
        "unknown capability type: nullptr + message");
    check(std::strcmp(core->getPluginName(), "DFlash2Selector") == 0, "plugin name");
    check(std::strcmp(core->getPluginVersion(), "3") == 0, "plugin version");
    check(std::strcmp(core->getPluginNamespace(), "") == 0, "plugin namespace");
    check(std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0, "build interface kind");
    check(build->getNbOutputs() == kOut, "getNbOutputs == 5");

    // -- output dtypes -----------------------------------------------------------------------------
    DataType outT[kOut];
    DataType inT[kIn] = {DataType::kHALF, DataType::kINT32, DataType::kBF16, DataType::kINT32, DataType::kBF16,
        DataType::kBF16, DataType::kFLOAT, DataType::kFLOAT};
    check(build->getOutputDataTypes(outT, kOut, inT, kIn) == 0 && outT[0] == DataType::kINT32
            && outT[1] == DataType::kINT32 && outT[2] == DataType::kFLOAT && outT[3] == DataType::kFLOAT
            && outT[4] == DataType::kFLOAT,
        "getOutputDataTypes -> int32, int32, float32, float32, float32");
    check(build->getOutputDataTypes(outT, 4, inT, kIn) != 0 && contains(logger.take(), "expected 5 outputs, found 4"),
        "an engine expecting the 4 outputs of plugin version 2 is rejected");
    check(build->getOutputDataTypes(outT, kOut, inT, 6) != 0 && contains(logger.take(), "expected 8 inputs, found 6"),
        "the 6 inputs of plugin version 2 are rejected");
    inT[4] = DataType::kFLOAT;
    check(build->getOutputDataTypes(outT, kOut, inT, kIn) != 0, "mixed codebook dtypes rejected");
    check(contains(logger.take(), "must share a dtype"), "mixed dtype message");
    inT[4] = DataType::kBF16;
    inT[1] = DataType::kINT64;
    check(build->getOutputDataTypes(outT, kOut, inT, kIn) != 0, "int64 cand_ids rejected");
    check(contains(logger.take(), "cand_ids dtype expected int32, found int64"), "cand_ids dtype message");
    inT[1] = DataType::kINT32;
    inT[6] = DataType::kHALF;
    check(build->getOutputDataTypes(outT, kOut, inT, kIn) != 0
            && contains(logger.take(), "uniforms dtype expected float32, found float16"),
        "float16 uniforms rejected");
    inT[6] = DataType::kFLOAT;
    inT[7] = DataType::kBF16;
    check(build->getOutputDataTypes(outT, kOut, inT, kIn) != 0
            && contains(logger.take(), "temperature dtype expected float32, found bfloat16"),
        "bfloat16 temperature rejected");

    // -- formats -----------------------------------------------------------------------------------
    for (DataType tl : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
        for (DataType tc : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
        {
            Io io(2, 7, 16, 256, 1000, tl, tc);
            bool all = true;
            for (int pos = 0; pos < kAll; ++pos)
                all = all && build->supportsFormatCombination(pos, io.d, kIn, kOut);
            check(all, "every position supported for logits/codebook dtypes " + std::to_string(int(tl)) + "/"
                    + std::to_string(int(tc)));
        }
    struct Bad
    {
        int pos;
        DataType type;
        TensorFormat format;
        char const* what;
    };
    for (Bad const& b : {Bad{0, DataType::kINT32, TensorFormat::kLINEAR, "int32 cand_logits"},
             Bad{1, DataType::kFLOAT, TensorFormat::kLINEAR, "float cand_ids"},
             Bad{2, DataType::kINT8, TensorFormat::kLINEAR, "int8 gate"},
             Bad{4, DataType::kFLOAT, TensorFormat::kLINEAR, "pred_codebook dtype != gate dtype"},
             Bad{5, DataType::kHALF, TensorFormat::kLINEAR, "succ_codebook dtype != gate dtype"},
             Bad{3, DataType::kINT64, TensorFormat::kLINEAR, "int64 anchor"},
             Bad{6, DataType::kHALF, TensorFormat::kLINEAR, "half uniforms"},
             Bad{7, DataType::kINT32, TensorFormat::kLINEAR, "int32 temperature"},
             Bad{8, DataType::kFLOAT, TensorFormat::kLINEAR, "float draft_ids"},
             Bad{10, DataType::kHALF, TensorFormat::kLINEAR, "half path_scores"},
             Bad{11, DataType::kINT32, TensorFormat::kLINEAR, "int32 confidence"},
             Bad{12, DataType::kBF16, TensorFormat::kLINEAR, "bf16 draft_probs"},
             Bad{0, DataType::kHALF, TensorFormat::kCHW32, "non-linear format"}})
    {
        Io io(2, 7, 16, 256, 1000, DataType::kHALF, DataType::kBF16);
        io.d[b.pos].desc.type = b.type;
        io.d[b.pos].desc.format = b.format;
        check(!build->supportsFormatCombination(b.pos, io.d, kIn, kOut), std::string("rejects ") + b.what);
    }
    check(logger.take().empty(), "rejected combinations are not errors");
    Io io0(2, 7, 16, 256, 1000);
    check(!build->supportsFormatCombination(kAll, io0.d, kIn, kOut), "out-of-range position rejected");
    check(contains(logger.take(), "position 13 out of range"), "out-of-range position message");
    check(!build->supportsFormatCombination(0, io0.d, 6, 4) && contains(logger.take(), "for 6 inputs / 4 outputs"),
        "the 6 inputs / 4 outputs of plugin version 2 rejected");

    // -- shapes ------------------------------------------------------------------------------------
    {
        ExprImpl impl;
        ExprBuilder eb(&impl);
        Dim batch(0, false), s7(7, true), k16(16, true), k8(8, true), r256(256, true), v1000(1000, true);
        Dim s6(6, true);
        auto shapes = [&](IDimensionExpr const* k, DimsExprs* out, IDimensionExpr const* uniformsS) {
            DimsExprs in[kIn];
            std::vector<std::vector<IDimensionExpr const*>> d
                = {{&batch, &s7, k}, {&batch, &s7, k}, {&batch, &s7, &r256}, {&batch}, {&v1000, &r256},
                    {&v1000, &r256}, {&batch, uniformsS}, {&batch}};
            for (int i = 0; i < kIn; ++i)
            {
                in[i].nbDims = static_cast<int32_t>(d[i].size());
                for (size_t j = 0; j < d[i].size(); ++j)
                    in[i].d[j] = d[i][j];
            }
            return build->getOutputShapes(in, kIn, nullptr, 0, out, kOut, eb);
        };
        DimsExprs out[kOut];
        check(shapes(&k16, out, &s7) == 0, "getOutputShapes succeeds: " + logger.take());
        check(out[0].nbDims == 2 && out[0].d[0] == &batch && out[0].d[1] == &s7, "draft_ids is [B, S]");
        check(out[1].nbDims == 2 && out[1].d[0] == &batch && out[1].d[1] == &s7, "path_index is [B, S]");
        check(out[2].nbDims == 3 && out[2].d[0] == &batch && out[2].d[2]->isConstant()
                && out[2].d[2]->getConstantValue() == 16,
            "path_scores is [B, S, 16]");
        check(out[3].nbDims == 2 && out[3].d[0] == &batch && out[3].d[1] == &s7, "confidence is [B, S]");
        check(out[4].nbDims == 3 && out[4].d[0] == &batch && out[4].d[1] == &s7 && out[4].d[2]->isConstant()
                && out[4].d[2]->getConstantValue() == 16,
            "draft_probs is [B, S, 16]");
        check(shapes(&k8, out, &s7) != 0, "K=8 inputs rejected by a top_k=16 plugin");
        check(contains(logger.take(), "K of the inputs expected top_k=16, found 8"), "K mismatch message");
        check(shapes(&k16, out, &s6) != 0 && contains(logger.take(), "dim S of input uniforms expected 7, found 6"),
            "uniforms [B, 6] rejected when S = 7");
    }
    Io good2(2, 7, 16, 256, 1000);
    check(build->configurePlugin(good2.d, kIn, good2.d + kIn, kOut) == 0, "configurePlugin good: " + logger.take());
    check(build->configurePlugin(good2.d, 6, good2.d + kIn, 4) != 0
            && contains(logger.take(), "expected 8 inputs / 5 outputs, found 6 / 4"),
        "configurePlugin with the 6 inputs / 4 outputs of plugin version 2 rejected");
    Io dyn(-1, 7, 16, 256, 1000);
    check(build->configurePlugin(dyn.d, kIn, dyn.d + kIn, kOut) == 0, "configurePlugin dynamic batch: " + logger.take());
    Io badR(2, 7, 16, 128, 1000);
    check(build->configurePlugin(badR.d, kIn, badR.d + kIn, kOut) != 0, "configurePlugin R=128 vs rank=256 rejected");
    check(contains(logger.take(), "R of the inputs expected rank=256, found 128"), "rank mismatch message");
    Io badS(2, 7, 16, 256, 1000);
    badS.d[2].desc.dims.d[1] = 6;
    check(build->configurePlugin(badS.d, kIn, badS.d + kIn, kOut) != 0, "inconsistent S rejected");
    check(contains(logger.take(), "dim S of input gate expected 7, found 6"), "inconsistent S message");
    Io badT(2, 7, 16, 256, 1000);
    badT.d[7].desc.dims.d[0] = 3;
    check(build->configurePlugin(badT.d, kIn, badT.d + kIn, kOut) != 0
            && contains(logger.take(), "dim B of input temperature expected 2, found 3"),
        "temperature [3] rejected when B = 2");
    Io badU(2, 7, 16, 256, 1000);
    badU.d[6].desc.dims.nbDims = 3;
    badU.d[6].desc.dims.d[2] = 16;
    check(build->configurePlugin(badU.d, kIn, badU.d + kIn, kOut) != 0
            && contains(logger.take(), "input uniforms expected rank 2 [BS], found rank 3"),
        "uniforms of rank 3 rejected");
    std::vector<PluginTensorDesc> plain = good2.plain();
    check(runtime->onShapeChange(plain.data(), kIn, plain.data() + kIn, kOut) == 0,
        "onShapeChange good: " + logger.take());

    // -- enqueue without touching a GPU: empty batch is a no-op, bad shapes are errors -------------
    Io empty(0, 7, 16, 256, 1000);
    std::vector<PluginTensorDesc> emptyDesc = empty.plain();
    void const* noIn[kIn] = {};
    void* noOut[kOut] = {};
    check(runtime->enqueue(emptyDesc.data(), emptyDesc.data() + kIn, noIn, noOut, nullptr, nullptr) == 0,
        "enqueue with B=0 is a no-op: " + logger.take());
    Io k65(1, 7, 65, 256, 1000);
    std::vector<PluginTensorDesc> k65Desc = k65.plain();
    check(runtime->enqueue(k65Desc.data(), k65Desc.data() + kIn, noIn, noOut, nullptr, nullptr) != 0,
        "enqueue with K=65 fails");
    check(contains(logger.take(), "top_k=16, found 65"), "enqueue K message");

    // -- clone and serialization round trip ------------------------------------------------------
    std::string const original = serialized(plugin);
    check(original == "top_k=16;rank=256;output_multiplier=1.5;logit_softcap=30;mode=\"greedy\";",
        "serialized fields: " + original);
    IPluginV3* copy = plugin->clone();
    check(copy != nullptr && copy != plugin && serialized(copy) == original, "clone keeps attributes");
    auto* rt = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* ser = rt->getFieldsToSerialize();
    IPluginV3* restored = creator->createPlugin("selector", ser, TensorRTPhase::kRUNTIME);
    check(restored != nullptr && serialized(restored) == original, "kRUNTIME round trip keeps attributes");
    delete copy;
    if (restored != nullptr)
        delete restored;

    // -- attachToContext routes errors to the context's recorder -----------------------------------
    Recorder recorder;
    ResourceContext ctx;
    ctx.recorder = &recorder;
    IPluginV3* attached = runtime->attachToContext(&ctx);
    check(attached != nullptr && attached != plugin, "attachToContext returns a new plugin");
    if (attached != nullptr)
    {
        auto* art = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        std::vector<PluginTensorDesc> badDesc = badR.plain();
        check(art->onShapeChange(badDesc.data(), kIn, badDesc.data() + kIn, kOut) != 0,
            "attached plugin rejects bad R");
        check(recorder.descs.size() == 1 && contains(recorder.descs[0], "rank=256"), "error went to the recorder");
        check(logger.take().empty(), "no logger message once a recorder is attached");
        delete attached;
    }
    delete plugin;

    // -- mode "sample": created, serialized, cloned, restored; enqueue validates as in greedy mode ----
    {
        Fields f;
        f.i("top_k", 16).i("rank", 256).s("mode", "sample");
        PluginFieldCollection fc = f.fc();
        IPluginV3* sp = creator->createPlugin("sampler", &fc, TensorRTPhase::kBUILD);
        check(sp != nullptr, "createPlugin mode=sample: " + logger.take());
        if (sp != nullptr)
        {
            std::string const want = serialized(sp);
            check(want == "top_k=16;rank=256;output_multiplier=1;logit_softcap=0;mode=\"sample\";",
                "sample-mode serialized fields: " + want);
            auto* srt = static_cast<IPluginV3OneRuntime*>(sp->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
            IPluginV3* back = creator->createPlugin("sampler", srt->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
            check(back != nullptr && serialized(back) == want, "sample-mode kRUNTIME round trip keeps mode");
            IPluginV3* twin = sp->clone();
            check(twin != nullptr && serialized(twin) == want, "sample-mode clone keeps mode");
            check(srt->enqueue(emptyDesc.data(), emptyDesc.data() + kIn, noIn, noOut, nullptr, nullptr) == 0,
                "sample-mode enqueue with B=0 is a no-op: " + logger.take());
            check(srt->enqueue(k65Desc.data(), k65Desc.data() + kIn, noIn, noOut, nullptr, nullptr) != 0
                    && contains(logger.take(), "top_k=16, found 65"),
                "sample-mode enqueue with K=65 fails");
            delete back;
            delete twin;
            delete sp;
        }
    }

    // -- the library's CPU twin on a hand-built sample case (no GPU): the walk follows the sample --
    // Row 0 (anchor 0): unary (0, ln 3), pair 0 -> q = (1/4, 3/4) at T = 1; u = 0.2 < 1/4 picks index 0,
    // not the argmax 1. Row 1's predecessor is then token cand_ids[0][0] = 1, whose P row (0, 1) makes
    // candidate 0 (Q row (0, 5)) score 5: greedy from there is index 0; had the walk followed the argmax
    // (token 2, P row (1, 0)) candidate 1 (Q row (4, 0)) would win.
    using SelectCpu = int32_t (*)(Df2SelectArgs const*, char*, size_t);
    auto selectCpu = reinterpret_cast<SelectCpu>(dlsym(handle, "dflash2_select_path_cpu"));
    check(selectCpu != nullptr, "plugin library exports dflash2_select_path_cpu");
    if (selectCpu != nullptr)
    {
        float const logits[4] = {0.0F, std::log(3.0F), 0.0F, 0.0F};
        int32_t const ids[4] = {1, 2, 3, 4};
        float const gate[4] = {1.0F, 1.0F, 1.0F, 1.0F};
        int32_t const anchor[1] = {0};
        float const P[10] = {0, 0, 0, 1, 1, 0, 0, 0, 0, 0};
        float const Q[10] = {0, 0, 0, 0, 0, 0, 0, 5, 4, 0};
        float const uniforms[2] = {0.2F, 0.9F};
        float const temperature[1] = {1.0F};
        int32_t draftIds[2] = {-1, -1};
        int32_t pathIndex[2] = {-1, -1};
        float scores[4] = {};
        float conf[2] = {};
        float probs[4] = {};
        Df2SelectArgs a{};
        a.cand_logits = logits;
        a.cand_ids = ids;
        a.gate = gate;
        a.anchor = anchor;
        a.pred_codebook = P;
        a.succ_codebook = Q;
        a.uniforms = uniforms;
        a.temperature = temperature;
        a.draft_ids = draftIds;
        a.path_index = pathIndex;
        a.path_scores = scores;
        a.confidence = conf;
        a.draft_probs = probs;
        a.B = 1;
        a.S = 2;
        a.K = 2;
        a.R = 2;
        a.V = 5;
        a.output_multiplier = 1.0F;
        a.mode = DF2_MODE_SAMPLE;
        char err[256] = {};
        check(selectCpu(&a, err, sizeof err) == 0, std::string("CPU twin sample case runs: ") + err);
        check(pathIndex[0] == 0 && draftIds[0] == 1, "sample u=0.2 walks the non-argmax candidate 0");
        check(std::fabs(probs[0] - 0.25F) < 1e-6F && std::fabs(probs[1] - 0.75F) < 1e-6F, "q = (1/4, 3/4)");
        check(std::fabs(conf[0] - 0.25F) < 1e-6F, "confidence of the sampled candidate = softmax = 1/4");
        check(scores[2] == 5.0F && scores[3] == 0.0F, "row 1 is scored from the sampled predecessor (token 1)");
        check(pathIndex[1] == 0 && draftIds[1] == 3, "row 1 (u=0.9, q ~ (1, 0.0067)) walks index 0");
        a.mode = DF2_MODE_GREEDY;
        a.uniforms = nullptr;
        a.temperature = nullptr;
        check(selectCpu(&a, err, sizeof err) == 0, std::string("greedy mode needs no uniforms/temperature: ") + err);
        check(pathIndex[0] == 1 && draftIds[0] == 2 && probs[0] == 0.0F && probs[1] == 1.0F,
            "greedy walks the argmax with q one-hot");
        check(scores[2] == 0.0F && scores[3] == 4.0F && pathIndex[1] == 1, "greedy row 1 follows token 2");
        a.mode = DF2_MODE_SAMPLE;
        check(selectCpu(&a, err, sizeof err) != 0 && contains(err, "tensor uniforms is NULL"),
            "sample mode with NULL uniforms rejected");
        a.mode = 2;
        check(selectCpu(&a, err, sizeof err) != 0 && contains(err, "mode code expected 0 (greedy) or 1 (sample), found 2"),
            "unknown mode code rejected");
    }

    // -- bad or missing attributes: nullptr + a message naming the attribute ---------------------
    struct BadAttrs
    {
        char const* what;
        Fields fields;
        char const* message;
    };
    std::vector<BadAttrs> bad;
    auto add = [&](char const* what, Fields f, char const* msg) { bad.push_back({what, std::move(f), msg}); };
    add("missing top_k", Fields().i("rank", 256), "required attribute 'top_k' is missing");
    add("missing rank", Fields().i("top_k", 16), "required attribute 'rank' is missing");
    add("top_k 65", Fields().i("top_k", 65).i("rank", 256), "attribute 'top_k' expected 1..64, found 65");
    add("top_k 0", Fields().i("top_k", 0).i("rank", 256), "attribute 'top_k' expected 1..64, found 0");
    add("rank 1025", Fields().i("top_k", 16).i("rank", 1025), "attribute 'rank' expected 1..1024, found 1025");
    add("multiplier 0", Fields().i("top_k", 16).i("rank", 256).f("output_multiplier", 0.0F),
        "attribute 'output_multiplier' expected > 0");
    add("softcap -1", Fields().i("top_k", 16).i("rank", 256).f("logit_softcap", -1.0F),
        "attribute 'logit_softcap' expected >= 0");
    add("mode beam", Fields().i("top_k", 16).i("rank", 256).s("mode", "beam"),
        "attribute 'mode' expected one of ['greedy', 'sample'], found 'beam'");
    add("mode Sample", Fields().i("top_k", 16).i("rank", 256).s("mode", "Sample"),
        "attribute 'mode' expected one of ['greedy', 'sample'], found 'Sample'");
    add("mode empty", Fields().i("top_k", 16).i("rank", 256).s("mode", ""),
        "attribute 'mode' expected one of ['greedy', 'sample'], found ''");
    add("unknown", Fields().i("top_k", 16).i("rank", 256).i("temperature", 1), "unknown attribute 'temperature'");
    add("float top_k", Fields().f("top_k", 16.0F).i("rank", 256), "attribute 'top_k' expected an INT32 field");
    add("int multiplier", Fields().i("top_k", 16).i("rank", 256).i("output_multiplier", 2),
        "attribute 'output_multiplier' expected a FLOAT32 field");
    add("twice", Fields().i("top_k", 16).i("top_k", 16).i("rank", 256), "attribute 'top_k' given twice");
    for (BadAttrs& b : bad)
    {
        PluginFieldCollection fc = b.fields.fc();
        IPluginV3* p = creator->createPlugin("bad", &fc, TensorRTPhase::kBUILD);
        std::string const msg = logger.take();
        check(p == nullptr, std::string("createPlugin rejects ") + b.what);
        check(contains(msg, b.message), std::string("message for ") + b.what + ": got '" + msg + "'");
        delete p;
    }
    IPluginV3* none = creator->createPlugin("null", nullptr, TensorRTPhase::kBUILD);
    check(none == nullptr && contains(logger.take(), "'top_k' is missing"), "null field collection rejected");
    int32_t two = 2;
    PluginField wrongLen("top_k", &two, PluginFieldType::kINT32, 2);
    PluginFieldCollection wl{1, &wrongLen};
    check(creator->createPlugin("len", &wl, TensorRTPhase::kBUILD) == nullptr
            && contains(logger.take(), "attribute 'top_k' expected 1 value, found 2"),
        "field with length 2 rejected");

    std::printf("%s: %d checks, %d failed\n", gFailures == 0 ? "PASS" : "FAIL", gChecks, gFailures);
    return gFailures == 0 ? 0 : 1;
}
