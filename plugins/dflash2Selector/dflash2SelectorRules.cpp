/*
 * DFlash2Selector: attribute parsing and the contract's shape / dtype rules (no TensorRT state).
 * Errors are std::invalid_argument (attributes) or a non-empty problem string (shapes, dtypes),
 * both naming the attribute or input, what was expected and what was found.
 */
#include "dflash2SelectorPlugin.h"

#include "dflash2SelectorMath.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

using namespace nvinfer1;

namespace dflash2
{
namespace
{

char const* const kInputNames[kNB_INPUTS]
    = {"cand_logits", "cand_ids", "gate", "anchor", "pred_codebook", "succ_codebook", "uniforms", "temperature"};
// Symbolic dims of each input, as in the contract: B S K / B S K / B S R / B / V R / V R / B S / B.
char const* const kInputDims[kNB_INPUTS] = {"BSK", "BSK", "BSR", "B", "VR", "VR", "BS", "B"};

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


bool isFloatType(DataType t)
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
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
    if (modeCode(a.mode) < 0)
        fail("attribute 'mode' expected one of ['greedy', 'sample'], found " + quoted(a.mode));
    return a;
}

int32_t modeCode(std::string const& mode)
{
    return mode == "greedy" ? DF2_MODE_GREEDY : mode == "sample" ? DF2_MODE_SAMPLE : -1;
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
    for (int32_t i : {6, 7})
        if (t[i] != DataType::kFLOAT)
            return std::string("input ") + kInputNames[i] + " dtype expected float32, found " + typeName(t[i]);
    return "";
}

} // namespace dflash2
