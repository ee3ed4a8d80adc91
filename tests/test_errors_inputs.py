"""Every file dflash2-export reads, malformed every way the probe found: exit 2, one line naming the
file and the problem, no traceback, inputs byte-identical, nothing left behind."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2 import draft_vocab, tiny
from dflash2.cli import export as export_cli
from tests.errorcheck import one_line_error, snapshot


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One pristine pair (sharded target, so the index is exercised) copied per case."""
    root = tmp_path_factory.mktemp("clean")
    target = tiny.make_target(root / "target", family="llama", shards=2)
    drafter = tiny.make_drafter(root / "drafter", target, version=2)
    return drafter, target


@pytest.fixture
def pair(tmp_path, clean):
    d, t = tmp_path / "in" / "drafter", tmp_path / "in" / "target"
    shutil.copytree(clean[0], d)
    shutil.copytree(clean[1], t)
    return d, t


def edit_json(path, fn):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(fn(doc)))


def set_key(key, value, sub=None):
    def fn(cfg):
        (cfg[sub] if sub else cfg)[key] = value
        return cfg
    return fn


def drop(*keys):
    def fn(cfg):
        for k in keys:
            cfg.pop(k, None)
            cfg.get("dflash_config", {}).pop(k, None)
        return cfg
    return fn


def split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def rewrite_header(path, fn, data_fn=lambda d: d):
    header, data = split(path)
    h = json.dumps(fn(header)).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data_fn(data))


def first_tensor(h):
    return next(k for k in h if k != "__metadata__")


def shard(t):
    return sorted(t.glob("*.safetensors"))[0]


def set_entry(field, value):
    def fn(h):
        h[first_tensor(h)][field] = value
        return h
    return fn


def edit_tensor(folder, name, fn):
    f = next(p for p in sorted(folder.glob("*.safetensors")) if name in load_file(str(p)))
    t = load_file(str(f))
    t[name] = fn(t[name])
    save_file(t, str(f))


CFG_T, CFG_D = "target/config.json", "drafter/config.json"
CASES = {
    # configs
    "config_list": (lambda d, t: (t / "config.json").write_text("[1, 2]"),
                    CFG_T, "expected a JSON object {...}, found a JSON list"),
    "config_number": (lambda d, t: (d / "config.json").write_text("7"), CFG_D, "found a JSON number"),
    "config_string": (lambda d, t: (d / "config.json").write_text('"x"'), CFG_D, "found a JSON string"),
    "config_not_utf8": (lambda d, t: (t / "config.json").write_bytes(b'{"a": "\xff\xfe"}'), CFG_T,
                        "expected UTF-8 JSON text, found undecodable bytes"),
    "rope_parameters_list": (lambda d, t: edit_json(t / "config.json", set_key("rope_scaling", [1])), CFG_T,
                             "rope_scaling: expected an object {...} or absent, found a JSON list"),
    "rope_theta_string": (lambda d, t: edit_json(t / "config.json", set_key("rope_theta", "big")), CFG_T,
                          "rope_theta: expected a number, found 'big'"),
    "layer_types_number": (lambda d, t: edit_json(d / "config.json", set_key("layer_types", 3)), CFG_D,
                           "layer_types: expected 1 entries"),
    "dflash_config_list": (lambda d, t: edit_json(d / "config.json", set_key("dflash_config", [])), CFG_D,
                           "dflash_config: expected an object {...} or absent, found a JSON list"),
    "generation_top_p": (lambda d, t: (t / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 7})), "target/generation_config.json",
        "generation_config.json: field top_p expected a number in (0, 1], found 7"),
    "dflash_config_null": (lambda d, t: edit_json(d / "config.json", set_key("dflash_config", None)), CFG_D,
                           "dflash_config: expected an object with mask_token_id (DFlash drafters keep the mask id, "
                           "taps and block settings there), found null"),  # was: "mask_token_id ... missing"
    "block_size_missing": (lambda d, t: edit_json(d / "config.json", drop("block_size")), CFG_D,
                           "block_size: expected an integer >= 2 (top level or in dflash_config), "
                           "found the field missing"),
    "block_size_string": (lambda d, t: edit_json(d / "config.json", set_key("block_size", "8", "dflash_config")),
                          CFG_D, "dflash_config.block_size: expected an integer, found '8'"),
    "taps_bool": (lambda d, t: edit_json(d / "config.json", set_key("target_layer_ids", [True], "dflash_config")),
                  CFG_D, "target_layer_ids: expected a non-empty list of integers, found [True]"),
    "bos_string": (lambda d, t: edit_json(t / "config.json", set_key("bos_token_id", "<s>")), CFG_T,
                   "bos_token_id: expected an integer or null, found '<s>'"),
    "head_dim_float": (lambda d, t: edit_json(t / "config.json", set_key("head_dim", 16.5)), CFG_T,
                       "head_dim: expected an integer, found 16.5"),
    "vocab_mismatch_names_both": (lambda d, t: edit_json(t / "config.json", set_key("vocab_size", 999)), CFG_T,
                                  "drafter vocab_size 384 != target vocab_size 999 (drafter"),
    # safetensors headers
    "truncated_data": (lambda d, t: shard(t).write_bytes(shard(t).read_bytes()[:-100]), "model-00001-of-00002",
                       "problem(s): tensor data ends at byte"),
    "truncated_to_4_bytes": (lambda d, t: (d / "model.safetensors").write_bytes(b"\x01\x02\x03\x04"),
                             "drafter/model.safetensors", "found a truncated file of 4 bytes"),
    "header_too_long": (lambda d, t: (d / "model.safetensors").write_bytes(struct.pack("<Q", 10 ** 12) + b"{}"),
                        "drafter/model.safetensors", "a header length of 1000000000000 bytes"),
    "header_list": (lambda d, t: rewrite_header(d / "model.safetensors", lambda h: [1]),
                    "drafter/model.safetensors", "found a JSON list"),
    "header_entry_not_object": (lambda d, t: rewrite_header(d / "model.safetensors", lambda h: {**h, "x": 5}),
                                "drafter/model.safetensors", "x: expected an object {dtype, shape, data_offsets}"),
    "header_bad_dtype": (lambda d, t: rewrite_header(d / "model.safetensors", set_entry("dtype", "F33")),
                         "drafter/model.safetensors", "dtype: expected one of"),
    "header_bad_shape": (lambda d, t: rewrite_header(d / "model.safetensors", set_entry("shape", [-1])),
                         "drafter/model.safetensors", "shape: expected a list of non-negative integers"),
    "header_bad_offsets": (lambda d, t: rewrite_header(d / "model.safetensors", set_entry("data_offsets", [0])),
                           "drafter/model.safetensors", "data_offsets: expected [begin, end]"),
    "trailing_bytes": (lambda d, t: rewrite_header(d / "model.safetensors", lambda h: h, lambda x: x + b"junk"),
                       "drafter/model.safetensors", "(trailing bytes)"),
    "header_not_json": (lambda d, t: (d / "model.safetensors").write_bytes(struct.pack("<Q", 3) + b"\xff\xfe{"),
                        "drafter/model.safetensors", "expected a JSON safetensors header, found unreadable bytes"),
    # the sharded index
    "index_list": (lambda d, t: (t / "model.safetensors.index.json").write_text("[]"),
                   "model.safetensors.index.json", "weight_map: expected a JSON object mapping tensor -> shard"),
    "index_not_utf8": (lambda d, t: (t / "model.safetensors.index.json").write_bytes(b"\xff\xff"),
                       "model.safetensors.index.json", "expected a JSON index, found unreadable JSON"),
    "index_escapes_folder": (lambda d, t: edit_json(t / "model.safetensors.index.json",
                                                    lambda i: {"weight_map": {"x": "../evil.safetensors"}}),
                             "model.safetensors.index.json", "shard file names (*.safetensors, no folders)"),
    "index_wrong_shard": (lambda d, t: edit_json(t / "model.safetensors.index.json", lambda i: {
        "weight_map": {k: sorted(set(i["weight_map"].values()))[0] for k in i["weight_map"]}}),
        "model.safetensors.index.json", "each tensor in the shard the index names"),
    # draft vocabulary
    "draft_vocab_list": (lambda d, t: (d / draft_vocab.FILE).write_text("[1, 2]"), draft_vocab.FILE,
                         "format: expected 'dflash2-draft-vocab', found 'list'"),
    "draft_vocab_string_ids": (lambda d, t: draft_vocab.write(d, list(range(16)), 384, "t") and edit_json(
        d / draft_vocab.FILE, set_key("ids", ["1"] * 16)), draft_vocab.FILE, "ids: expected a list of integer"),
    # tokenizer files export copies (checked before any weight loads)
    "tokenizer_config_not_json": (lambda d, t: (t / "tokenizer_config.json").write_text("{oops"),
                                  "target/tokenizer_config.json", "file: expected valid JSON, found a parse error"),
    "tokenizer_json_a_list": (lambda d, t: (t / "tokenizer.json").write_text("[]"), "target/tokenizer.json",
                              "file: expected a JSON object {...}, found a JSON list"),
    "chat_template_not_text": (lambda d, t: edit_json(t / "tokenizer_config.json", set_key("chat_template", 5)),
                               "target/tokenizer_config.json", "chat_template: expected a string (a jinja template)"),
    # weights
    "integer_weights": (lambda d, t: edit_tensor(d, "norm.weight", lambda x: x.to(torch.int64)), "drafter",
                        "weights: expected float tensors (F32, F16, BF16, F64), found 1 of another dtype: "
                        "norm.weight (I64)"),
    "nan_in_target": (lambda d, t: edit_tensor(t, "model.norm.weight", lambda x: x.index_fill(0, torch.tensor([3]),
                                                                                                float("nan"))),
                      "target", "weights: expected finite values (no NaN / inf), found 1 tensor(s): model.norm.weight"),
    "inf_in_drafter": (lambda d, t: edit_tensor(d, "fc.weight", lambda x: x.index_fill(0, torch.tensor([0]),
                                                                                         float("inf"))),
                       "drafter", "found 1 tensor(s): fc.weight in model.safetensors (0 NaN, 128 inf)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_one_line_nothing_changed_nothing_left(tmp_path, pair, capsys, case):
    drafter, target = pair
    corrupt, where, what = CASES[case]
    corrupt(drafter, target)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    code = export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(out), "--quiet"])
    msg = one_line_error(capsys.readouterr().err, "dflash2-export")
    assert code == 2 and where in msg and what in msg, msg
    assert snapshot(tmp_path) == before  # inputs byte-identical, no output, no temp folder
