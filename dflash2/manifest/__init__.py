"""The folder contracts: `ExportManifest` (dflash2-export) and `EngineManifest` (dflash2-build).

Every stage after export reads its input folder through ONE `load()`, which checks, and reports
all at once as (file, field, expected, found):
    the JSON is an object, `format` is one this reader asked for, `format_version` and
    `contract_version` are not newer than this dflash2's ("made by a newer dflash2 (version X > Y)"),
    `manifest_sha256` matches the canonical JSON of the rest (an edited field is detected),
    every field is present with its type, no unknown field, the semantic rules of `check()`,
    and (check_files=True) every listed file exists with its recorded size and sha256.
ONE writer, `write()`, fills `files` (sha256 + size of every file) and `manifest_sha256`.
Readers use attributes (`m.kv.rows.target`); nothing outside this package indexes a manifest by key.

Plain JSON, hashlib and dataclasses: no torch, no onnx (the runtime imports this on edge boards).

The package (this file re-exports every public name: `from dflash2 import manifest as mf; mf.load(...)`):
  records.py    the records a manifest is made of, graph signatures
  schema.py     ExportManifest / EngineManifest, format constants, ManifestError, check()
  jsonio.py     typed JSON <-> dataclasses, the canonical-JSON seal (content_sha256)
  reading.py    load(): the one reader
  sealing.py    sha256 and file tables, the file checks, write() / reseal(): the one writer
  hashcache.py  the record of files hashed and unchanged since, so a start does not re-hash gigabytes

How to add a field (no redesign needed):
  - a field or an optional section: add it to the dataclass with a default (`None` for a section,
    e.g. `quantization: Quantization | None = None` with `@dataclass class Quantization: method: str;
    bits: int; block_size: int | None = None; graphs: list[str] = field(default_factory=list)`).
    Manifests written before it load with the default; an older dflash2 reading a newer file
    names the field it does not know. Types allowed: int, float, str, bool, Any, list[X],
    dict[str, X], X | None, and dataclasses of those.
  - a field the engine folder must carry too: put it in `ModelFacts` (both manifests have it; the
    engine manifest copies every ModelFacts field from its export).
  - a new graph output (e.g. a drafter `confidence` output): nothing to change here; graphs list
    their outputs as `IoSpec`s read from the ONNX file.
  - a change that makes an older reader misread a file (a field changes meaning, a required field):
    bump FORMAT_VERSION; older readers then refuse it as made by a newer dflash2.
"""

from __future__ import annotations

from dflash2.manifest.jsonio import content_sha256
from dflash2.manifest.reading import load
from dflash2.manifest.records import (CAPABILITY_ROLES, KV_KINDS, REQUIRED_ROLES, STATE_KINDS, BuildInfo, Context,
                                      Deviation, DraftVocab, EngineEntry, FileEntry, Flavours, Graph, GraphIo, IoSpec,
                                      Kv, KvRows, KvSignature, Plugin, ProfileRecord, QuantizedGraph, Quantization,
                                      Selector, Signature, Sources, StateSignature, Tokenizer, Validation,
                                      capabilities_of)
from dflash2.manifest.window import WINDOW_KINDS, WindowSignature
from dflash2.manifest.schema import (ENGINE_FORMAT, EXPORT_FORMAT, FORMAT_VERSION, KINDS, MIN_CONTRACT_VERSION, NAME,
                                     Q4_FLAVOUR, ROW_CHECK, EngineManifest, ExportManifest, Manifest, ManifestError, ModelFacts,
                                     Sealed)
from dflash2.manifest.sealing import (check_files, checked_file_problems, file_problems, file_table, remember_hashes,
                                      reseal, sha256, write)

__all__ = ["CAPABILITY_ROLES", "ENGINE_FORMAT", "EXPORT_FORMAT", "FORMAT_VERSION", "KINDS", "KV_KINDS",
           "MIN_CONTRACT_VERSION", "NAME", "Q4_FLAVOUR", "REQUIRED_ROLES", "ROW_CHECK", "STATE_KINDS", "BuildInfo", "Context",
           "Deviation", "DraftVocab", "EngineEntry", "EngineManifest", "ExportManifest", "FileEntry", "Flavours",
           "Graph", "GraphIo", "IoSpec", "Kv", "KvRows", "KvSignature", "Manifest", "ManifestError", "ModelFacts",
           "Plugin",
           "ProfileRecord", "QuantizedGraph", "Quantization", "Sealed", "Selector", "Signature", "Sources",
           "StateSignature", "Tokenizer", "Validation", "WINDOW_KINDS", "WindowSignature", "capabilities_of",
           "check_files", "checked_file_problems",
           "content_sha256", "file_problems", "file_table", "load", "remember_hashes", "reseal", "sha256", "write"]
