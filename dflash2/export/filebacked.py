"""The streamed reference's large resident tensors moved into file-backed memory for the export.

A DFlash2 drafter's selector keeps two vocabulary-sized codebooks resident in the layer-streamed reference
(StreamedDrafter): [248,320, 256] fp32 each at Qwen3.5's vocabulary, 485 MB together, held from the checkpoint's
load to the export's end, through the target's stages that never read them (the truncated validation, the int4
deviation, the row check: each peak carried them). The reference reads only some of their rows (the candidates'),
and the selector's trace writes them out once. `file_backed` writes each such tensor to an unlinked temporary file
and maps it back as the same values (np.memmap, copy of the bytes): the kernel pages in what is read and may drop
it again, so an untouched codebook costs no resident memory. The file goes where the export writes (its disk).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

FILE_BACKED_BYTES = 64 << 20  # a tensor this large or larger is mapped; the rest stay as they are


def file_backed(module: torch.nn.Module, folder: Path | None = None, min_bytes: int = FILE_BACKED_BYTES) -> list[str]:
    """Every CPU parameter of `module` of at least min_bytes replaced by a file-backed parameter with the same
    values (bfloat16 ones excepted: numpy has no such dtype); returns their names."""
    moved = []
    for prefix, mod in module.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.device.type != "cpu" or p.dtype == torch.bfloat16 or p.numel() * p.element_size() < min_bytes:
                continue
            a = p.detach().contiguous().numpy()
            fh = tempfile.TemporaryFile(dir=folder)  # unlinked at once: the mapping keeps its pages
            a.tofile(fh)
            fh.flush()
            mapped = np.memmap(fh, dtype=a.dtype, mode="r+", shape=a.shape)
            setattr(mod, name, torch.nn.Parameter(torch.from_numpy(mapped), requires_grad=p.requires_grad))
            moved.append(f"{prefix}.{name}" if prefix else name)
            del a
    return moved
