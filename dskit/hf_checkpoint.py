"""What a local Hugging Face checkpoint holds, read from its safetensors headers alone (no torch).

The plan checks `model.path` with this before any job is queued, and the trainer again before loading
(files can change between render and start): a missing, truncated, misindexed or FP8 shard is one line
and exit 2, never a traceback or a hang halfway through loading.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from dskit.errors import SpecError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


def read_header(path: Path) -> dict[str, Any]:
    """The tensor table of one .safetensors file (names -> dtype, shape, offsets), without its data."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
            size = path.stat().st_size
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise SpecError("model.path", f"{path} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    for name, t in header.items():
        end = t.get("data_offsets", [0, 0])[1] if isinstance(t, dict) else None
        if end is None or 8 + n + end > size:
            raise SpecError("model.path", f"{path} is truncated: tensor {name} ends past the file's end")
    return header


def check_checkpoint(path: str) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint at `path` -> (dtype, shape); SpecError for anything unusable."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpecError("model.path", f"{index} is not a safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        raise SpecError(
            "model.path", f"{root} has neither {INDEX} nor {SINGLE}: save it with `save_pretrained`"
        )
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise SpecError(
            "model.path", f"{root}: {len(missing)} shard(s) listed in {INDEX} are missing, e.g. {missing[0]}"
        )
    tensors: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        for name, t in read_header(root / f).items():
            if weight_map is not None and weight_map.get(name) not in (None, f):
                raise SpecError(
                    "model.path", f"{root / f} holds {name}, which {INDEX} places in another shard"
                )
            tensors[name] = (t["dtype"], t["shape"])
    if weight_map is not None:
        absent = [n for n in weight_map if n not in tensors]
        if absent:
            raise SpecError(
                "model.path",
                f"{root / weight_map[absent[0]]} lacks {absent[0]} ({len(absent)} tensors of {INDEX} absent)",
            )
    fp8 = [n for n, (dt, _) in tensors.items() if dt in FP8_DTYPES]
    if fp8:
        raise SpecError("model.path", f"{root} holds FP8 tensors (e.g. {fp8[0]}); {FP8_HOWTO}")
    return tensors


FP8_HOWTO = (
    "dskit trains from bf16 weights: convert them first with DeepSeek-V3's inference/fp8_cast_bf16.py "
    "(--input-fp8-hf-path IN --output-bf16-hf-path OUT), copy config.json without quantization_config, "
    "and set model.path to OUT"
)


def has_weights(path: str) -> bool:
    """Whether `path` is meant to provide weights (an index or any .safetensors), checked or not."""
    p = Path(path)
    return p.is_dir() and ((p / INDEX).is_file() or any(p.glob("*.safetensors")))
