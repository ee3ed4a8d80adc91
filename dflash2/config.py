"""Target and drafter configs read from Hugging Face folders, validated before any weight loads.

Per-family differences are data (dflash2.families: one module per target family), not code paths. No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from dflash2.errors import CheckpointError, Dflash2Error
from dflash2.folders import OutputError
from dflash2.inputs import parse_json

# architecture -> version; MuseGlimmerAssistantModel is Meta's DFlash (v1) format (dflash2.drafter_formats)
DRAFTER_ARCHS = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2, "MuseGlimmerAssistantModel": 1}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TargetConfig:
    arch: str
    family: str
    qk_norm: bool
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DrafterConfig:
    arch: str
    version: int  # 1 = DFlash, 2 = DFlash2
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None  # None: the target's (Meta's format; drafter_formats.for_target fills it)
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    block_size: int
    num_target_layers: int | None  # None: the target's (Meta's format)
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_causal: tuple[bool, ...]
    layer_window: tuple[int | None, ...]
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    logit_softcap: float = 0.0
    input_embedding_scale: float = 1.0
    trained_block_size: int | None = None  # the block its config.json says it was trained for (None: block_size);
    # more than block_size where an export drafts fewer rows (`dflash2-export --draft-block`): the manifest says so
    format: str = "zlab"  # the checkpoint's layout: "zlab" (DFlashDraftModel / DFlash2DraftModel) or
    # "meta-assistant" (MuseGlimmerAssistantModel: its own config fields and tensor names, dflash2.drafter_formats)

    @property
    def num_drafts(self) -> int:  # S
        return self.block_size - 1

    def to_dict(self) -> dict:
        return asdict(self)


def read_config(folder: str | Path) -> tuple[Path, dict]:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(folder, "folder", "a Hugging Face model folder", "no such directory")
    if not path.is_file():
        raise CheckpointError(path, "config.json", "a config.json file", "nothing")
    raw = parse_json(path, path.read_bytes(), "config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(path, "config.json", "a JSON object {...}", f"a JSON {_json_type(raw)}")
    return path, raw


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                  "chat_template.json")


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; every other content named (file, expected, found)."""
    doc = parse_json(path, path.read_bytes())
    if not isinstance(doc, dict):
        raise CheckpointError(path, "file", "a JSON object {...}", f"a JSON {_json_type(doc)}")
    return doc


def check_tokenizer_files(folder: str | Path) -> None:
    """The tokenizer files export copies are JSON objects and the chat template is text: a broken one
    is refused at export, naming it, instead of surfacing when dflash2-run first encodes a prompt."""
    folder = Path(folder)
    for name in TOKENIZER_JSON:
        if (folder / name).is_file():
            doc = read_json_object(folder / name)
            if name == "tokenizer_config.json" and doc.get("chat_template") is not None and \
                    not isinstance(doc["chat_template"], str):
                raise CheckpointError(folder / name, "chat_template", "a string (a jinja template)",
                                      f"a JSON {_json_type(doc['chat_template'])}")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(jinja, "file", "UTF-8 text (a jinja template)", "undecodable bytes") from None


UNUSED_ROWS = 128  # embedding rows a matching tokenizer may leave unused (at least; else 5% of the vocabulary)


def tokenizer_id_count(path: Path) -> int:
    """1 + the largest id `tokenizer.json` produces (added tokens included)."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own Exception type for malformed files
        raise CheckpointError(path, "file", "a tokenizers JSON file", f"unreadable ({str(e)[:120]})") from None
    return 1 + max(vocab.values(), default=-1)


def check_tokenizer_vocab(path: Path, ids: int, vocab_size: int) -> None:
    """The tokenizer belongs to the model: none of its ids past the embedding, and not far fewer ids than
    rows. Models pad their vocabulary (Qwen3: 151,669 token ids for 151,936 rows, Phi-3: 32,011 for 32,064),
    so up to max(UNUSED_ROWS, 5%) unused rows pass; a tokenizer of another model does not (a 564-token one
    beside 151,936 rows encoded prompts the target never saw and decoded its output to nothing)."""
    slack = max(UNUSED_ROWS, vocab_size // 20)
    where = "the target's config.json vocab_size"
    if ids > vocab_size:
        raise CheckpointError(path, "vocabulary", f"token ids < {vocab_size} ({where})",
                              f"ids up to {ids - 1}", "this tokenizer belongs to another model")
    if ids < vocab_size - slack:
        raise CheckpointError(path, "vocabulary", f"about {vocab_size} token ids ({where}; at most {slack} "
                              f"unused rows)", f"{ids} ids", "this tokenizer belongs to another model")


def _json_type(v) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _object(path: Path, raw: dict, name: str) -> dict:
    """A nested object field (absent or null: empty)."""
    v = raw.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise CheckpointError(path, name, "an object {...} or absent", f"a JSON {_json_type(v)}: {v!r}"[:120])
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Fields:
    """Typed access to a config dict; every error names the file and the field."""

    def __init__(self, path: Path, raw: dict, prefix: str = ""):
        self.path, self.raw, self.prefix = path, raw, prefix

    def _err(self, name: str, expected: str, found) -> CheckpointError:
        return CheckpointError(self.path, self.prefix + name, expected, found)

    def int(self, name: str, default=..., minimum: int | None = None) -> int:
        v = self.raw.get(name, default)
        if v is ...:
            raise self._err(name, "an integer", "the field missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(name, "an integer", repr(v))
        if minimum is not None and v < minimum:
            raise self._err(name, f">= {minimum}", v)
        return v

    def float(self, name: str, default=...) -> float:
        v = self.raw.get(name, default)
        if v is ...:
            raise self._err(name, "a number", "the field missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(name, "a number", repr(v))
        return float(v)

    def bool(self, name: str, default=...) -> bool:
        v = self.raw.get(name, default)
        if v is ...:
            raise self._err(name, "true or false", "the field missing")
        if not isinstance(v, bool):
            raise self._err(name, "true or false", repr(v))
        return v


def _architecture(path: Path, raw: dict, known: dict) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise CheckpointError(path, "architectures", "a list with one architecture name", repr(archs))
    if archs[0] not in known:
        raise CheckpointError(path, "architectures", f"one of {sorted(known)}", repr(archs[0]),
                              "unsupported architecture")
    return archs[0]


def _rope(path: Path, raw: dict) -> RopeConfig:
    params, scaling = _object(path, raw, "rope_parameters"), _object(path, raw, "rope_scaling")
    merged = {**scaling, **params}
    f = _Fields(path, merged, "rope_parameters.")
    theta = f.float("rope_theta", _Fields(path, raw).float("rope_theta", 10000.0))
    if not theta > 0:
        raise CheckpointError(path, "rope_theta", "> 0", theta)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise CheckpointError(path, "rope_parameters.rope_type", f"one of {ROPE_TYPES}", repr(kind),
                              "unsupported RoPE scaling")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(theta=float(theta), type=kind, factor=f.float("factor"),
                      low_freq_factor=f.float("low_freq_factor", 1.0),
                      high_freq_factor=f.float("high_freq_factor", 4.0),
                      original_max_position_embeddings=f.int("original_max_position_embeddings", 8192))


def _attention_shape(path: Path, f: _Fields) -> dict:
    hidden = f.int("hidden_size", minimum=1)
    heads = f.int("num_attention_heads", minimum=1)
    kv = f.int("num_key_value_heads", heads, minimum=1)
    if heads % kv:
        raise CheckpointError(path, "num_key_value_heads", f"a divisor of num_attention_heads={heads}", kv)
    head_dim = f.raw.get("head_dim") or 0
    if not head_dim:
        if hidden % heads:
            raise CheckpointError(path, "hidden_size", f"a multiple of num_attention_heads={heads}", hidden)
        head_dim = hidden // heads
    head_dim = f.int("head_dim", head_dim, minimum=2)
    if head_dim % 2:
        raise CheckpointError(path, "head_dim", "an even number (RoPE)", head_dim)
    act = f.raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(path, "hidden_act", "'silu'", repr(act))
    return dict(hidden_size=hidden, intermediate_size=f.int("intermediate_size", minimum=1),
                num_layers=f.int("num_hidden_layers", minimum=1), num_heads=heads, num_kv_heads=kv,
                head_dim=head_dim, vocab_size=f.int("vocab_size", minimum=2),
                rms_norm_eps=f.float("rms_norm_eps", 1e-6), rope=_rope(path, f.raw),
                attention_bias=f.bool("attention_bias", False))


def load_target_config(folder: str | Path) -> TargetConfig:
    """A target folder's config, read by the family claiming its `architectures` (dflash2.families), for the
    export, the trainer and the dense reference; a family without export templates is refused in one line."""
    from dflash2 import families

    path, raw = read_config(folder)
    supported = sorted(families.exportable_archs())
    fam, arch = families.claim(path, raw, supported)
    if not fam.exportable:
        raise CheckpointError(path, "architectures", f"one of {supported}", repr(arch), fam.not_exportable)
    return fam.read_config(path, raw, arch)


def read_dense_target(path: Path, raw: dict, arch: str, family: str, qk_norm: bool) -> TargetConfig:
    """A dense Llama-shaped config.json (Llama, Qwen3: dflash2.families.dense) -> TargetConfig."""
    f = _Fields(path, raw)
    if raw.get("use_sliding_window"):
        raise CheckpointError(path, "use_sliding_window", "false (sliding-window targets are not supported)", True)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(_is_int(e) for e in eos_ids):
        raise CheckpointError(path, "eos_token_id", "an integer or a list of integers", repr(eos))
    bos = raw.get("bos_token_id")
    if bos is not None and not _is_int(bos):
        raise CheckpointError(path, "bos_token_id", "an integer or null", repr(bos))
    shape = _attention_shape(path, f)
    bad_eos = [e for e in eos_ids if not 0 <= e < shape["vocab_size"]]
    if bad_eos:
        raise CheckpointError(path, "eos_token_id", f"ids < vocab_size={shape['vocab_size']}", bad_eos)
    return TargetConfig(
        arch=arch, family=family, qk_norm=qk_norm, **shape,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        mlp_bias=f.bool("mlp_bias", False),
        max_position_embeddings=f.int("max_position_embeddings", 4096, minimum=1),
        eos_token_ids=eos_ids, bos_token_id=bos)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's rule: one layer -> the middle; else evenly rounded points in [1, L-3].

    Kept exactly (repeats included, e.g. (1, 1) on a 4-layer target): a checkpoint without
    target_layer_ids was trained with these taps, and its fc weight has one block per entry."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def distinct_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """Taps for a drafter we train ourselves: z-lab's rule, widened then deduplicated where the target
    has too few layers for `count` distinct ones (tiny targets), so no layer is tapped twice."""
    L = num_target_layers
    taps = default_target_layer_ids(L, count)
    if count > 1 and (len(set(taps)) < count or min(taps) < 0 or max(taps) >= L):
        start = min(1, L - 1)
        end = max(start, L - 2)
        taps = tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))  # in [0, L-1]
    return tuple(dict.fromkeys(taps))


def _attention_modes(path: Path, raw: dict, num_layers: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """vLLM rule: top-level is_causal wins, then dflash_config.causal, else causal == sliding layer."""
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or \
            any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise CheckpointError(path, "layer_types",
                              f"{num_layers} entries of 'full_attention' / 'sliding_attention'", repr(layer_types))
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and (not _is_int(window) or window < 1):
        raise CheckpointError(path, "sliding_window", "a positive integer (sliding_attention layers)", repr(window))
    forced = raw.get("is_causal")
    if forced is None:
        forced = _object(path, raw, "dflash_config").get("causal")
    if forced is not None and not isinstance(forced, bool):
        raise CheckpointError(path, "is_causal", "true, false or absent", repr(forced))
    causal = tuple(bool(forced) if forced is not None else t == "sliding_attention" for t in layer_types)
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return causal, windows


def check_draft_block(block_size, trained: int, path: Path) -> None:
    """A drafter drafts at most the block it was trained for (past it: positions it never learned to draft)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= trained:
        raise OutputError(f"--draft-block: expected an integer in 2..{trained} (the training block_size in {path}), "
                           f"found {block_size!r}")


def load_drafter_config(folder: str | Path, block_size: int | None = None) -> DrafterConfig:
    """block_size: the rows a round drafts, 2..the block the drafter was trained for (None: that block);
    `dflash2-export --draft-block`, docs/export.md."""
    path, raw = read_config(folder)
    arch = _architecture(path, raw, DRAFTER_ARCHS)
    from dflash2 import drafter_formats  # imports this module: read lazily

    if arch == drafter_formats.META_ARCH:
        return drafter_formats.read_meta_assistant(path, raw, arch, block_size)
    version = DRAFTER_ARCHS[arch]
    dc = _object(path, raw, "dflash_config")
    # dflash_config entries win over top-level ones (z-lab's _draft_value)
    merged = {**raw, **dc}
    f = _Fields(path, raw)
    d = _Fields(path, merged, "dflash_config.")
    shape = _attention_shape(path, f)
    num_target = d.int("num_target_layers", minimum=1)
    taps = merged.get("target_layer_ids")
    if taps is None:
        taps = default_target_layer_ids(num_target, shape["num_layers"])
    if not isinstance(taps, (list, tuple)) or not taps or not all(_is_int(t) for t in taps):
        raise CheckpointError(path, "dflash_config.target_layer_ids", "a non-empty list of integers", repr(taps))
    bad = [t for t in taps if not 0 <= t < num_target]
    if bad:
        raise CheckpointError(path, "dflash_config.target_layer_ids",
                              f"layer ids in [0, {num_target - 1}] (num_target_layers={num_target})", bad)
    causal, windows = _attention_modes(path, raw, shape["num_layers"])
    extra = {}
    if version == 2:
        extra = dict(conv_kernel_size=d.int("conv_kernel_size", 2, minimum=1),
                     conv_group_size=d.int("conv_group_size", 16, minimum=1),
                     selector_rank=d.int("selector_rank", 256, minimum=1),
                     selector_top_k=d.int("selector_top_k", 16, minimum=1))
        if shape["hidden_size"] % extra["conv_group_size"]:
            raise CheckpointError(path, "dflash_config.conv_group_size",
                                  f"a divisor of hidden_size={shape['hidden_size']}", extra["conv_group_size"])
        if extra["selector_top_k"] > shape["vocab_size"]:
            raise CheckpointError(path, "dflash_config.selector_top_k",
                                  f"<= vocab_size={shape['vocab_size']}", extra["selector_top_k"])
    if "block_size" not in merged:  # no default: a drafter is trained for one block size (z-lab's is 16, ours 8)
        raise CheckpointError(path, "block_size", "an integer >= 2 (top level or in dflash_config)",
                              "the field missing", "the drafter's training block size; there is no safe default")
    mult = d.float("output_multiplier", 1.0)
    if not mult > 0:
        raise CheckpointError(path, "dflash_config.output_multiplier", "> 0", mult)
    cap = merged.get("final_logit_softcapping")
    cap = 0.0 if cap is None else d.float("final_logit_softcapping")
    if cap < 0:
        raise CheckpointError(path, "dflash_config.final_logit_softcapping", ">= 0 or null", cap)
    if "mask_token_id" not in merged:  # say why: most often the whole dflash_config is null or absent
        dcv = raw.get("dflash_config", "absent")
        raise CheckpointError(path, "dflash_config", "an object with mask_token_id (DFlash drafters keep the mask "
                              "id, taps and block settings there)",
                              "null" if dcv is None else "absent" if dcv == "absent" else "an object without it")
    mask = d.int("mask_token_id", minimum=0)
    if mask >= shape["vocab_size"]:
        raise CheckpointError(path, "dflash_config.mask_token_id", f"< vocab_size={shape['vocab_size']}", mask)
    trained = d.int("block_size", minimum=2)
    if block_size is not None:
        check_draft_block(block_size, trained, path)
    return DrafterConfig(
        arch=arch, version=version, **shape, block_size=trained if block_size is None else block_size,
        num_target_layers=num_target, target_layer_ids=tuple(taps), mask_token_id=mask,
        layer_causal=causal, layer_window=windows, output_multiplier=mult, logit_softcap=cap,
        input_embedding_scale=d.float("input_embedding_scale", 1.0), trained_block_size=trained, **extra)


def check_pair(drafter: DrafterConfig, target: TargetConfig, drafter_dir: str | Path, target_dir: str | Path) -> None:
    """The drafter uses the target's embedding, LM head and hidden states: sizes must agree. Neither
    file is blamed: either may be the one that changed. A format that leaves fields to the target (Meta's) has its
    taps and mask id checked against the target's (drafter_formats.for_target)."""
    pairs = [("hidden_size", drafter.hidden_size, "hidden_size", target.hidden_size),
             ("vocab_size", drafter.vocab_size, "vocab_size", target.vocab_size),
             ("num_target_layers", drafter.num_target_layers, "num_hidden_layers", target.num_layers)]
    for dfield, dval, tfield, tval in pairs:
        if dval is not None and dval != tval:  # None: a field the drafter's format takes from the target
            raise PairError(Path(drafter_dir) / "config.json", dfield, dval, Path(target_dir) / "config.json",
                            tfield, tval)
    from dflash2.drafter_formats import for_target

    for_target(drafter, target, drafter_dir)


class PairError(CheckpointError):
    def __init__(self, dpath: Path, dfield: str, dval, tpath: Path, tfield: str, tval):
        self.file, self.field, self.expected, self.found = str(dpath), dfield, f"target {tfield} {tval}", str(dval)
        Dflash2Error.__init__(self, f"drafter {dfield} {dval} != target {tfield} {tval} (drafter {dpath}, target "
                                    f"{tpath}): a drafter runs only with the target it was trained for")
