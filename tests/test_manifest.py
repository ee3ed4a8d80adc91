"""The typed folder contract (dflash2.manifest): one load() that reports every problem at once,
a version policy, the manifest's own checksum, and one writer."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2 import manifest as mf
from dflash2.ops import contract as C
from tests.exports import edit_manifest


@pytest.fixture
def copy(export_dir, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(export_dir, out)
    return out


def _problems(folder, **kw) -> list[str]:
    with pytest.raises(mf.ManifestError) as e:
        mf.load(folder, **kw)
    assert str(folder / mf.NAME) in str(e.value)  # the file is named
    return e.value.problems


def test_load_is_typed_and_write_round_trips(copy):
    m = mf.load(copy, mf.ExportManifest)
    assert isinstance(m, mf.ExportManifest) and isinstance(m.kv.rows, mf.KvRows)
    assert m.graphs["target"].inputs[1].name == "past_kv" and m.selector.top_k > 0
    assert m.manifest_sha256 == mf.content_sha256(json.loads((copy / mf.NAME).read_text()))
    (copy / mf.NAME).unlink()
    mf.write(copy, m)
    assert mf.load(copy) == m


@pytest.mark.parametrize("text, found", [("[1, 2]", "a list [1, 2]"), ("3", "an integer 3"),
                                         ('"x"', 'a string "x"'), ("{", "a parse error at line 1")])
def test_not_an_object(copy, text, found):
    (copy / mf.NAME).write_text(text)
    (problem,) = _problems(copy)
    assert found in problem


def test_a_missing_section_is_reported_not_a_keyerror(copy):
    edit_manifest(copy, lambda m: m.pop("kv"))
    assert _problems(copy) == ["kv: expected an object (Kv), found nothing (missing)"]


def test_newer_versions_refuse(copy):
    edit_manifest(copy, lambda m: m.update(format_version=mf.FORMAT_VERSION + 1,
                                           contract_version=C.CONTRACT_VERSION + 5))
    problems = _problems(copy)
    assert f"made by a newer dflash2 (version {mf.FORMAT_VERSION + 1} > {mf.FORMAT_VERSION})" in problems[0]
    assert f"made by a newer dflash2 (version {C.CONTRACT_VERSION + 5} > {C.CONTRACT_VERSION})" in problems[1]


def test_older_format_says_reexport(copy):
    edit_manifest(copy, lambda m: m.update(format_version=1))
    assert "made by an older dflash2: re-export" in _problems(copy)[0]


def test_unknown_fields_are_named(copy):
    edit_manifest(copy, lambda m: (m.update(speed="fast"), m["kv"].update(paged=True)))
    problems = _problems(copy)
    assert any(p.startswith("manifest: unknown field(s) ['speed']") for p in problems)
    assert any(p.startswith("kv: unknown field(s) ['paged']") for p in problems)


def test_edited_field_is_detected(copy):
    data = json.loads((copy / mf.NAME).read_text())
    data["created"] += " "  # (a vocab_size edit is also named against the logits' shape)
    (copy / mf.NAME).write_text(json.dumps(data))
    (problem,) = _problems(copy)
    assert problem.startswith("manifest_sha256: expected ") and "manifest.json was edited after it was written" in problem


def test_every_problem_at_once(copy):
    def edit(m):
        m["block_size"] = "8"
        m["kv"]["rows"]["target"] = [2, 2, "x"]
        m["graphs"].pop("drafter")
        m["dtype"] = "int4"

    edit_manifest(copy, edit)
    (copy / "drafter.onnx.data").write_bytes(b"changed")
    problems = _problems(copy)
    assert 'block_size: expected an integer, found a string "8"' in problems
    assert 'kv.rows.target[2]: expected an integer, found a string "x"' in problems
    assert "graphs.drafter: expected a graph, found none" in problems
    assert "dtype: expected one of ['float32', 'float16', 'bfloat16'], found 'int4'" in problems
    assert any(p.startswith("files.drafter.onnx.data: expected") for p in problems)
    assert not any("num_drafts" in p for p in problems)  # a rule over a mistyped field stays silent


def test_wrong_kind(copy):
    (problem,) = _problems(copy, kinds=mf.EngineManifest)
    assert problem == "format: expected one of ['dflash2-engines'], found 'dflash2-export'"


def test_files_unchecked_on_request(copy):
    (copy / "drafter.onnx.data").write_bytes(b"changed")
    assert mf.load(copy, check_files=False).format == mf.EXPORT_FORMAT


def test_signatures_are_written_and_checked_against_the_graphs(copy):
    """Each graph's typed signature is in the manifest; a resealed edit that makes it disagree with the graph's
    own io, drops a role the runtime binds, or breaks its KV binding is refused with the field named."""
    m = mf.load(copy, mf.ExportManifest)
    t, d = m.signature("target"), m.signature("drafter")
    assert t.kv.kind == "prefix" and t.has("logits") and d.has("confidence") and d.has("lattice")
    assert d.has("sampled-walk") and m.signature("drafter", tensorrt=True).kv.kind == "fixed"
    cases = [
        (lambda g: g["drafter"]["signature"]["outputs"].pop("cand_ids"),
         "graphs.drafter.signature: expected roles ['cand_ids']"),
        (lambda g: g["drafter"]["signature"]["kv"].update(present=["new_ctx_kv", "new_ctx_kv"]),
         "graphs.drafter.signature.kv: a prefix binding expects one past and one present tensor, found 1 and 2"),
        (lambda g: g["target"]["signature"]["inputs"].update(ids="tokens"),
         "graphs.target.signature: inputs expected ['input_ids', 'past_kv'] (the graph's), found ['past_kv', 'tokens']"),
        (lambda g: g["target"]["tensorrt_signature"]["kv"].update(length=None),
         "graphs.target.tensorrt_signature.kv.length: expected the valid-length input of a fixed binding"),
    ]
    for i, (edit, want) in enumerate(cases):
        folder = copy.parent / f"forged-{i}"
        shutil.copytree(copy, folder)
        edit_manifest(folder, lambda data: edit(data["graphs"]))
        assert any(want in p for p in _problems(folder)), (want, _problems(folder))
