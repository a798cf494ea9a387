"""Which FlashAttention an environment has, read by distribution rather than by module: flash-attn
2.8.3 bundles an old `flash_attn/cute` of its own that cannot import without FlashAttention-4's
dependencies, and flash-attn-4 leaves `flash_attn` a bare namespace, so neither module says which is
installed. Torch-free: `dskit doctor` asks it even where torch itself is broken; the trainer asks it
before it plans on a kernel (dskit/train/model.py resolve_attention)."""

from __future__ import annotations

import importlib
import importlib.metadata

#: (distribution, module) of each FlashAttention backend: FA4 is the CuTe-DSL build in flash-attn-4
KERNELS = {
    "flash_attention_4": ("flash-attn-4", "flash_attn.cute"),
    "flash_attention_2": ("flash-attn", "flash_attn"),
}


def probe(backend: str) -> tuple[str | None, str | None]:
    """(version, None) if `backend`'s distribution is installed and its module imports; (None, None) if
    it is not installed; (version, the import error's first line) if it is installed but broken."""
    dist, module = KERNELS[backend]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None, None
    try:
        importlib.import_module(module)
    except Exception as e:  # an ABI mismatch ("undefined symbol") or a missing dependency
        return version, str(e).splitlines()[0][:200]
    return version, None
