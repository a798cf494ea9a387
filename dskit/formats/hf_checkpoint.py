"""What a local Hugging Face checkpoint holds, read from its safetensors headers alone (no torch).

The plan checks `model.path` with this before any job is queued, and the trainer again before loading
(files can change between render and start): a missing, truncated or misindexed shard, or FP8 weights
that break DeepSeek-V3's format (`check_fp8`), is one line and exit 2, never a traceback or a hang
halfway through loading.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dskit.errors import SpecError
from dskit.io import bounded_read

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


MAX_INDEX = 64 * 2**20  # an index maps tensor names to file names: tens of MB at the very most
#: config.json beside the weights; the catalog reads it with the same limit (dskit/catalog CONFIG_MAX_BYTES)
MAX_CONFIG = 1 << 20
#: headers and indexes are two or three levels deep
MAX_JSON_DEPTH = bounded_read.MAX_DEPTH
json_depth = bounded_read.json_depth  # the catalog's check of a config.json


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path: Path) -> dict[str, Any]:
    """The tensor table of one .safetensors file (names -> dtype, shape, offsets), without its data.

    Every entry is checked against the format: a dict with a str `dtype`, a list-of-ints `shape` and
    two non-negative int `data_offsets` [begin, end] within the file. Anything else is one line."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > min(MAX_HEADER, size - 8):
                why = "longer than the file" if n <= MAX_HEADER else f"over the {MAX_HEADER:,} it can be"
                raise bounded_read.TooLarge(path, f"has a header of {n:,} bytes, {why}")
            header = bounded_read.parse_json(f.read(n), f"{path}'s header")
    except bounded_read.TooLarge as e:
        raise SpecError("model.path", str(e)) from None
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise SpecError("model.path", f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise SpecError("model.path", f"{path}: safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    if not header:
        raise SpecError("model.path", f"{path}: safetensors header lists no tensors")
    for name, t in header.items():
        bad = None
        if not isinstance(t, dict):
            bad = "is not an object with dtype, shape and data_offsets"
        elif not isinstance(t.get("dtype"), str):
            bad = "has no string dtype"
        elif not isinstance(t.get("shape"), list) or not all(_is_int(x) and x >= 0 for x in t["shape"]):
            bad = "has no shape (a list of non-negative integers)"
        else:
            off = t.get("data_offsets")
            if (
                not isinstance(off, list)
                or len(off) != 2
                or not all(_is_int(x) and x >= 0 for x in off)
                or off[0] > off[1]
            ):
                bad = "has no data_offsets [begin, end] (non-negative integers, begin <= end)"
            elif 8 + n + off[1] > size:
                raise SpecError("model.path", f"{path} is truncated: tensor {name} ends past the file's end")
        if bad:
            raise SpecError("model.path", f"{path}: tensor {name!r} {bad}")
    return header


def _shard(root: Path, name: str, index: Path) -> Path:
    """A shard named by the index: a plain relative name inside the model directory. Judged by the name
    alone: the files themselves may be symlinks (the Hugging Face cache links snapshots/REV/x.safetensors
    to ../../blobs/HASH), which the user's directory, not the index, put there."""
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or "\0" in name:
        raise SpecError("model.path", f"{index} names shard {name!r}; only files inside {root} are allowed")
    return root / p


def read_index(index: Path) -> dict[str, str]:
    try:
        data = bounded_read.read_json(index, limit=MAX_INDEX, what="a safetensors index")
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        weight_map = data.get("weight_map")
    except bounded_read.TooLarge as e:
        raise SpecError("model.path", str(e)) from None
    except (OSError, ValueError) as e:
        raise SpecError("model.path", f"{index} is not a safetensors index: {e}") from None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise SpecError(
            "model.path", f"{index}: weight_map must be a non-empty mapping of tensor names to shard files"
        )
    return weight_map


def check_checkpoint(path: str) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint at `path` -> (dtype, shape); SpecError for anything unusable."""
    root = Path(path)
    index = root / INDEX
    try:
        has_index, has_single = index.is_file(), (root / SINGLE).is_file()
    except OSError as e:
        raise SpecError("model.path", f"cannot read {root}: {e.strerror or e}") from None
    if has_index:
        weight_map = read_index(index)
        files = sorted(set(weight_map.values()))
        for f in files:
            _shard(root, f, index)  # every name is checked before any shard is opened
    elif has_single:
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
    check_fp8(root, tensors)
    return tensors


def has_weights(path: str) -> bool:
    """Whether `path` is meant to provide weights (an index or any .safetensors), checked or not."""
    p = Path(path)
    return p.is_dir() and ((p / INDEX).is_file() or any(p.glob("*.safetensors")))


# DeepSeek-V3's FP8 format, as published (config.json and inference/fp8_cast_bf16.py): e4m3 weights,
# one float32 `<name>_scale_inv` per 128 x 128 block of `<name>`, blocks at the edges partial.
FP8_BLOCK = (128, 128)
FP8_WEIGHT_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPE = "F32"
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint in DeepSeek-V3's FP8 format: `weights` are the e4m3 tensors, each with a float32
    `<name>_scale_inv` of shape [..., ceil(rows / block[0]), ceil(cols / block[1])]."""

    block: tuple[int, int]
    weights: frozenset[str]

    def scale_of(self, weight: str) -> str:
        """The name of the scale tensor of FP8 weight `weight`."""
        return weight + SCALE_SUFFIX


def check_quantization_config(qc: Any, where: str, field_name: str = "model.path") -> tuple[int, int]:
    """The block size of a config.json `quantization_config` dskit can load (DeepSeek-V3's FP8); one
    SpecError line naming the field otherwise."""
    if not isinstance(qc, dict):
        raise SpecError(field_name, f"quantization_config in {where} must be an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise SpecError(
            field_name,
            f"quantization_config.quant_method in {where} is {method!r}; dskit loads bf16 weights or "
            "DeepSeek-V3's fp8 (e4m3, 128 x 128 block scales)",
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise SpecError(
            field_name, f"quantization_config.fmt in {where} is {fmt!r}; only 'e4m3' is supported"
        )
    block = qc.get("weight_block_size")
    if block != list(FP8_BLOCK):
        raise SpecError(
            field_name,
            f"quantization_config.weight_block_size in {where} is {block!r}; "
            f"DeepSeek-V3's FP8 format has {list(FP8_BLOCK)}",
        )
    return FP8_BLOCK


def _config_quantization(root: Path) -> Any:
    """config.json's quantization_config beside the weights (None without one or without config.json;
    an unreadable config.json is the catalog's to report, model_from_path reads it first)."""
    try:
        cfg = bounded_read.read_json(root / "config.json", limit=MAX_CONFIG, what="a config.json")
    except (OSError, ValueError):
        return None
    return cfg.get("quantization_config") if isinstance(cfg, dict) else None


def _blocks(shape: list[int], block: tuple[int, int]) -> list[int]:
    """The scale grid of a weight: its leading dims, then ceil division of the last two by the block."""
    return [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]


def check_fp8(root: Path, tensors: dict[str, tuple[str, list[int]]]) -> Fp8Format | None:
    """The checkpoint's FP8 format checked against its tensor table: None for a checkpoint without
    FP8 tensors or quantization_config; SpecError naming the first tensor or field that breaks it."""
    qc = _config_quantization(root)
    fp8 = sorted(n for n, (dt, _) in tensors.items() if dt in FP8_DTYPES)
    scales = sorted(n for n in tensors if n.endswith(SCALE_SUFFIX))
    if qc is None and not fp8 and not scales:
        return None
    if qc is None:
        raise SpecError(
            "model.path",
            f"{root} holds FP8 tensors (e.g. {(fp8 or scales)[0]}) but its config.json has no "
            "quantization_config (DeepSeek-V3's: quant_method fp8, fmt e4m3, weight_block_size [128, 128])",
        )
    block = check_quantization_config(qc, str(root / "config.json"))
    for name in fp8:
        dtype, shape = tensors[name]
        scale = name + SCALE_SUFFIX
        if dtype != FP8_WEIGHT_DTYPE:
            raise SpecError(
                "model.path", f"{root}: {name} is {dtype}; FP8 weights must be {FP8_WEIGHT_DTYPE}"
            )
        if not name.endswith(".weight") or len(shape) < 2:
            raise SpecError(
                "model.path",
                f"{root}: {name} is FP8 but no <module>.weight matrix ({shape}): not V3's layout",
            )
        if scale not in tensors:
            raise SpecError("model.path", f"{root}: {name} is FP8 but {scale} is missing")
        s_dtype, s_shape = tensors[scale]
        if s_dtype != FP8_SCALE_DTYPE or s_shape != _blocks(shape, block):
            raise SpecError(
                "model.path",
                f"{root}: {scale} is {s_dtype} {s_shape}; {name} {shape} needs {FP8_SCALE_DTYPE} "
                f"{_blocks(shape, block)} (one scale per {block[0]} x {block[1]} block)",
            )
    for scale in scales:
        weight = scale.removesuffix(SCALE_SUFFIX)
        if weight not in tensors or tensors[weight][0] != FP8_WEIGHT_DTYPE:
            what = tensors[weight][0] if weight in tensors else "missing"
            raise SpecError(
                "model.path", f"{root}: {scale} scales {weight}, which is {what}, not {FP8_WEIGHT_DTYPE}"
            )
    if not fp8:
        raise SpecError("model.path", f"{root}: config.json says fp8 but no tensor is {FP8_WEIGHT_DTYPE}")
    return Fp8Format(block=block, weights=frozenset(fp8))


def fp8_format(path: str) -> Fp8Format | None:
    """Whether the model directory at `path` holds DeepSeek-V3's FP8 format, validated from config.json
    and the safetensors headers alone (no torch): the format, or None for bf16/fp16 weights. A
    directory with only a config.json is judged by its quantization_config (`weights` then empty), so
    a plan can count FP8 before the weights are at hand. Anything broken is one SpecError line (exit 2)."""
    root = Path(path)
    if has_weights(path):
        return check_fp8(root, check_checkpoint(path))
    qc = _config_quantization(root)
    if qc is None:
        return None
    return Fp8Format(block=check_quantization_config(qc, str(root / "config.json")), weights=frozenset())
