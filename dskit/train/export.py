"""`dskit export`: AutoEP + ZeRO (stage 1, 2 or 3) checkpoint -> Hugging Face model directory (config.json + safetensors).

(A LoRA run's checkpoint holds no base: it is merged from model.path or the seeded init, or exported as a
peft adapter, by dskit/train/lora/export_adapter.py; steps 2-3's streaming and the check are shared.)

DeepSpeed's `save_16bit_model` refuses this case (expert shards live in expert-replica groups), so:
1. `deepspeed.checkpoint.ds_to_universal` consolidates the newest complete checkpoint into one fp32
   tensor per parameter, under AutoEP's module names;
2. `HF_FROM_AUTOEP` maps those names back to transformers' (router, fused expert weights);
3. the result streams into safetensors shards in the plan's precision, one shard in memory at a time
   (names and sizes are decided from the model's shapes first, so an index is written as for any
   published checkpoint); export memory is one shard plus one fp32 tensor, not the model. Models
   small enough to run here are verified: the exported model's logits on the probe batch must match
   the logits the trainer recorded at its final checkpoint; larger ones say the check was skipped.
Everything is written to a temporary sibling directory and renamed into place at the end.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dskit.errors import SpecError
from dskit.formats.hf_checkpoint import INDEX, SINGLE
from dskit.io.atomic import atomic_dir
from dskit.train.checkpoints import universal

if TYPE_CHECKING:  # torch is imported where it is used: `dskit export --help` stays light
    import torch
    from transformers import PretrainedConfig

    from dskit.plan.schema import Plan

#: name -> (shape, dtype) of each tensor of the exported model, in the model's order
Shapes = dict[str, tuple[tuple[int, ...], "torch.dtype"]]

SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
VERIFY_MAX_PARAMS = 3 * 10**9  # the logits check runs the model on this machine's CPU
VERIFY_RTOL = 2e-2  # relative L2 error; bf16 kernels differ in summation order (1e-3..1e-2)
VERIFY_FP8_RTOL = (
    0.1  # with every projection rounded to e4m3 (3 mantissa bits); measured: see test_export_fp8
)

# transformers name -> (AutoEP names, how to combine them). AutoEP stores experts as w1 (gate),
# w3 (up) [E, I, H] and w2 (down) [E, H, I]; transformers fuses gate and up as gate_up_proj [E, 2I, H].
_LAYER = r"(model\.layers\.\d+\.mlp)"
HF_FROM_AUTOEP: list[tuple[re.Pattern, list[str], Literal["cat1"] | None]] = [
    (re.compile(_LAYER + r"\.gate\.weight$"), [r"\1.router.gate.weight"], None),
    (re.compile(_LAYER + r"\.gate\.e_score_correction_bias$"), [r"\1.router.e_score_correction_bias"], None),
    (re.compile(_LAYER + r"\.experts\.gate_up_proj$"), [r"\1.experts.w1", r"\1.experts.w3"], "cat1"),
    (re.compile(_LAYER + r"\.experts\.down_proj$"), [r"\1.experts.w2"], None),
]


def autoep_sources(hf_name: str) -> tuple[list[str], str | None]:
    for pattern, templates, how in HF_FROM_AUTOEP:
        if pattern.search(hf_name):
            return [pattern.sub(t, hf_name) for t in templates], how
    return [hf_name], None


def _load_universal(udir: Path, name: str) -> torch.Tensor | None:
    import torch

    f = udir / "zero" / name / "fp32.pt"
    if not f.is_file():
        return None
    obj = torch.load(f, weights_only=False, map_location="cpu")
    return obj["param"] if isinstance(obj, dict) else obj


def export(
    run: str,
    output: str,
    *,
    force: bool = False,
    verify: bool = True,
    shard_bytes: int = SHARD_BYTES,
    adapter_only: bool = False,
    fp8: bool = False,
) -> Path:
    """The run's newest verified checkpoint as a Hugging Face model directory at `output`; a LoRA run's
    merged into its base, or with `adapter_only` its adapter in peft's format (export_adapter.py); with
    `fp8` in DeepSeek-V3's FP8 format (export_fp8.py)."""
    if fp8 and adapter_only:
        raise SpecError("--fp8", "an adapter is exported in the run's precision; leave out --adapter-only")
    plan, src, out = _inputs(run, output, force=force, adapter_only=adapter_only)  # refusals need no torch
    from dskit.train import export_fp8
    from dskit.train.lora import export_adapter
    from dskit.train.model import torch_dtype

    dtype = torch_dtype(plan.parallel.precision)
    with atomic_dir(out, kind="export", force=force) as work:
        if adapter_only:
            export_adapter.write_adapter(work, plan, src)
            meta = _write_meta(work, src, plan)
            print(f"wrote {out} (adapter of step {meta['step']} of {plan.name}, peft format)")
            return out
        config, shapes = _hf_shapes(plan, dtype)
        written = shapes
        if fp8:
            written, sources = export_fp8.layout(shapes)
            config.quantization_config = export_fp8.QUANTIZATION_CONFIG
        shards = plan_shards(written, shard_bytes)
        udir = None
        if plan.finetune is not None:
            tensor_of = export_adapter.merged_source(plan, src)
        else:
            udir = _to_universal(src, work / "universal")

            def tensor_of(name, shape, dt):
                return _consolidated(udir, src, name, shape, dt)

        _write_shards(
            work, written, shards, export_fp8.tensors(shapes, sources, tensor_of) if fp8 else tensor_of
        )
        _write_index(work, written, shards)
        config.save_pretrained(work)
        if fp8 and verify and plan.model.params_total <= VERIFY_MAX_PARAMS:
            n = export_fp8.check_weights(work, shapes, tensor_of)
            print(
                f"dskit: verified: {n} tensors read back by transformers within FP8's rounding of the trained"
            )
        if udir is not None:
            shutil.rmtree(udir)
            (work / "latest_universal").unlink(missing_ok=True)  # ds_to_universal writes it beside its output
        meta = _write_meta(work, src, plan)
        if verify:
            _verify(work, src, plan, dtype, VERIFY_FP8_RTOL if fp8 else VERIFY_RTOL)
    print(f"wrote {out} (step {meta['step']} of {plan.name})")
    return out


def _inputs(run: str, output: str, *, force: bool, adapter_only: bool = False) -> tuple[Plan, Path, Path]:
    """(the run's plan, its newest verified checkpoint, the output path), or SpecError before any work."""
    from dskit.formats.checkpoint_layout import newest_verified_tag
    from dskit.plan.schema import load_plan
    from dskit.train.local import run_file_of

    plan = load_plan(run_file_of(run))
    out = Path(output).resolve()
    if out.exists() and not force:  # before the expensive part; atomic_dir checks again
        raise SpecError("--output", f"{out} already exists; pass --force to replace it")
    if adapter_only and plan.finetune is None:
        raise SpecError(
            "--adapter-only", f"{plan.name} is a full fine-tune (finetune.method full): no adapter"
        )
    return plan, newest_verified_tag(Path(plan.run.checkpoint_dir)), out


def _to_universal(src: Path, udir: Path) -> Path:
    """`src` consolidated by DeepSpeed into one fp32 tensor per parameter under `udir`; on failure its
    output goes to a log file that the SpecError names."""
    print(f"dskit: consolidating {src} (deepspeed ds_to_universal)", flush=True)
    proc = subprocess.run(
        universal.command(src, udir), env=universal.environment(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        with tempfile.NamedTemporaryFile(
            "w", prefix="dskit-export-", suffix=".log", delete=False, encoding="utf-8", errors="replace"
        ) as log:
            log.write(f"{proc.stdout}\n{proc.stderr}")
        raise SpecError(
            "checkpoint",
            f"ds_to_universal failed on {src} (exit {proc.returncode}); its full output is in {log.name}",
        )
    return udir


def _hf_shapes(plan: Plan, dtype: torch.dtype) -> tuple[PretrainedConfig, Shapes]:
    """The Hugging Face config and its tensors' shapes, from a model built on the meta device (no memory
    for the weights): names and sizes are known before any data is read."""
    import torch
    from transformers import AutoModelForCausalLM

    from dskit.train.model import hf_config

    config = hf_config(plan.model.config, "sdpa")
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: (tuple(t.shape), _export_dtype(name, dtype)) for name, t in skeleton.state_dict().items()}
    return config, shapes


def _write_shards(work: Path, shapes: Shapes, shards: dict[str, list[str]], tensor_of) -> None:
    """Each shard's tensors, `tensor_of(name, shape, dtype)` in the export's dtype (consolidated from the
    universal checkpoint, or a LoRA run's base with its adapters merged)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    with tqdm(total=len(shapes), desc="exporting", unit="tensor", disable=None) as bar:
        for fname, names in shards.items():
            # one shard in memory at a time: the export's footprint is bounded by SHARD_BYTES plus
            # one tensor in fp32, whatever the model's size
            tensors = {}
            for name in names:
                tensors[name] = tensor_of(name, *shapes[name])
                bar.update()
            save_file(tensors, str(work / fname), metadata={"format": "pt"})
            del tensors


def _write_index(work: Path, shapes: Shapes, shards: dict[str, list[str]]) -> None:
    """The sharded checkpoint's index, as transformers writes it; a single file needs none."""
    if len(shards) > 1:
        total = sum(_nbytes(*shapes[n]) for n in shapes)
        weight_map = {n: fname for fname, names in shards.items() for n in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (work / INDEX).write_text(json.dumps(index, indent=1) + "\n")


def _write_meta(work: Path, src: Path, plan: Plan) -> dict:
    """dskit-export.json: which checkpoint, step, plan and model the export came from."""
    meta = {
        "source_checkpoint": str(src),
        "step": _step_of(src),
        "plan": plan.name,
        "model": plan.model.name,
    }
    (work / "dskit-export.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _step_of(src: Path) -> int:
    """The verified checkpoint's step, read again within dskit.json's limits."""
    from dskit.formats.checkpoint_layout import read_done

    done, problem = read_done(src)
    if problem:  # changed since it was verified
        raise SpecError("checkpoint", f"{src}: {problem}")
    return done["step"]


def _export_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    import torch

    # DeepSeek-V3's routing bias is an fp32 buffer in the published checkpoints
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_shards(shapes: Shapes, limit: int) -> dict[str, list[str]]:
    """File name -> tensor names, in model order, each file at most `limit` bytes (or one tensor).
    Decided from shapes alone, before any data is read, so shard names are final when written."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in shapes.items():
        n = _nbytes(shape, dtype)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups, 1)}


def _consolidated(
    udir: Path, src: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """One Hugging Face tensor from the universal checkpoint (AutoEP names mapped back)."""
    import torch

    sources, how = autoep_sources(name)
    parts = [_load_universal(udir, s) for s in sources]
    if any(p is None for p in parts):
        if name.endswith("e_score_correction_bias"):
            # a buffer, so not in the universal checkpoint: the module state DeepSpeed saved holds it
            # (the value loaded from model.path, or as training.balance aux_free moved it)
            return _saved_buffer(src, sources[0], shape)
        raise RuntimeError(f"checkpoint {src} has no tensor for {name} (looked for {sources})")
    t = torch.cat(parts, dim=1) if how == "cat1" else parts[0]
    del parts
    if t.numel() != math.prod(shape):
        raise RuntimeError(f"{name}: checkpoint has {tuple(t.shape)}, model expects {shape}")
    return t.reshape(shape).to(dtype).contiguous()


def _saved_buffer(src: Path, autoep_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A buffer (the routing bias) as the checkpoint carries it (dskit/train/checkpoints/routing_bias.py:
    rank 0's copy, identical on every rank). Zeros where none was saved (the model's init)."""
    import torch

    saved = _saved_biases(str(src)).get(autoep_name)
    if saved is None:
        return torch.zeros(shape, dtype=torch.float32)
    return saved.float().reshape(shape).contiguous()


@functools.cache
def _saved_biases(src: str) -> dict[str, torch.Tensor]:
    from dskit.train.checkpoints import routing_bias

    return routing_bias.read(Path(src)) or {}


def _verify(model_dir: Path, src: Path, plan: Plan, dtype: torch.dtype, rtol: float = VERIFY_RTOL) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    probe_file = src / "probe.pt"
    if not probe_file.is_file():
        print(f"dskit: not verifying: {src} has no probe logits (only the final checkpoint does)")
        return
    if plan.model.params_total > VERIFY_MAX_PARAMS:
        print(
            f"dskit: not verifying: {plan.model.params_total / 1e9:.1f}B parameters is too large for a CPU check"
        )
        return
    probe = torch.load(probe_file, weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    model.eval()
    with torch.no_grad():
        got = model(input_ids=probe["input_ids"]).logits.float()
    want = probe["logits"]
    err = ((got - want).norm() / want.norm()).item()
    if not err < rtol:
        raise RuntimeError(
            f"exported model disagrees with the trained one: relative logits error {err:.3g} "
            f">= {rtol} on the probe batch"
        )
    print(f"dskit: verified: exported logits match the trained model (relative error {err:.2e})")
