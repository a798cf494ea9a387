"""`dskit export` of a LoRA run: the adapter in peft's format, or the base merged with it.

The checkpoint's adapter.safetensors (dskit/train/lora/adapter_state.py) holds every trained tensor by the
trained model's parameter name: `<module>.lora_A.default.weight` for the adapters, `mlp.gate.weight`
for a router trained whole.

- `--adapter-only`: adapter_config.json + adapter_model.safetensors, peft's keys
  (`base_model.model.<module>.lora_A.weight`). peft 0.21 rewrites DeepSeek targets ending in
  gate_proj/up_proj/down_proj onto the routed experts when it loads a config (the v4 -> v5 MoE rename,
  peft/utils/transformers_weight_conversion.py), so the shared experts' and dense MLPs' linears are named
  as `target_parameters` (their 2-D weights, the same update W + alpha/r B A under the same keys), which
  that rewrite leaves alone; the attention projections stay `target_modules`. peft refuses dropout on
  parameter targets: such a config says lora_dropout 0 (dropout only acts in training). The router
  is a `modules_to_save` entry. Routed experts (dskit/train/lora/routed.py: A [E, r, in] and B [E, out, r]
  per expert for AutoEP's w1 gate, w3 up, w2 down) become `target_parameters` on transformers' fused
  `mlp.experts.gate_up_proj` [E, 2I, h] and `mlp.experts.down_proj` [E, h, I], in peft's ParamWrapper
  layout (peft/tuners/lora/layer.py: lora_A [E r, in] expert-major, lora_B [out, r E] rank-major, delta
  of expert e = scaling B_e A_e). peft gives gate_up_proj one adapter per expert, gate and up sharing
  its rank, while dskit trains them separately; the exact form is rank 2r with a block-diagonal B
  (A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]]) and alpha 2 alpha, so the scaling stays alpha / r:
  `rank_pattern` and `alpha_pattern` say so for `experts.gate_up_proj` alone (further training in
  peft then updates the whole 2r block, which is a superset of what dskit trained).
- merged: every tensor of the base, with alpha/r B A added to each adapted weight (in fp32, then the
  plan's precision) and the trained router in place, streamed shard by shard like a full export. The
  base comes from model.path's safetensors, read one tensor at a time; a run without model.path started
  from the seeded random init, which is rebuilt here (dskit/train/model.py draws it from (seed, name)).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dskit.errors import SpecError
from dskit.train.lora.routed import CHECKPOINT_NAME, is_routed

if TYPE_CHECKING:
    import torch

    from dskit.plan.schema import FinetunePlan, Plan

BIAS = "e_score_correction_bias"
#: adapter.safetensors' name of a module's A or B -> (module, "A" | "B")
_ADAPTER = re.compile(r"^(.*)\.lora_([AB])\.default\.weight$")
#: linears peft's loader would misread as fused experts (see the module docstring)
_MLP_LINEAR = re.compile(r"\.(gate_proj|up_proj|down_proj)$")
#: random-init bases are rebuilt whole in this process: beyond this, train from model.path instead
REBUILD_MAX_PARAMS = 3 * 10**9

TensorOf = Callable[[str, tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def trained(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from dskit.train.lora.adapter_state import ADAPTER_FILE

    return load_file(str(src / ADAPTER_FILE))


#: peft's target_parameters for the routed experts, and where its nested ParamWrappers keep each one's
#: A and B (peft wraps `experts` once per parameter: gate_up_proj inside, down_proj outside)
ROUTED_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
_PEFT_ROUTED_KEY = {"gate_up_proj": "experts.base_layer", "down_proj": "experts"}


def adapter_config(f: FinetunePlan, adapted: list[str], *, router_copy: bool = False) -> dict:
    """peft's LoraConfig for the adapted module names, as adapter_config.json holds it. `router_copy`:
    the routers are saved whole (peft's modules_to_save), trained or carrying a trained routing bias."""
    from peft import LoraConfig

    attention = sorted({m.rsplit(".", 1)[-1] for m in adapted if not _MLP_LINEAR.search(m)})
    params = sorted({".".join(m.split(".")[-2:]) + ".weight" for m in adapted if _MLP_LINEAR.search(m)})
    routed = "routed_experts" in f.targets
    if routed:
        params += list(ROUTED_TARGETS)
    config = LoraConfig(
        r=f.r,
        lora_alpha=f.alpha,
        lora_dropout=0.0 if params else f.dropout,
        target_modules=attention or None,
        target_parameters=params or None,
        # gate and up as one rank-2r adapter per expert (the module docstring)
        rank_pattern={ROUTED_TARGETS[0]: 2 * f.r} if routed else {},
        alpha_pattern={ROUTED_TARGETS[0]: 2 * f.alpha} if routed else {},
        modules_to_save=["mlp.gate"] if f.whole_params or router_copy else None,
        bias="none",
    )
    d = config.to_dict()
    for key, value in d.items():  # sets are not JSON
        if isinstance(value, set):
            d[key] = sorted(value)
    return d


def write_adapter(work: Path, plan: Plan, src: Path) -> None:
    """adapter_config.json + adapter_model.safetensors (peft's format) into `work`."""
    from safetensors.torch import save_file

    f = plan.finetune
    assert f is not None
    tensors = trained(src)
    out, adapted = {}, []
    for name, t in peft_routed(tensors).items():
        out[f"base_model.model.{name}"] = t.contiguous()
    for name, t in tensors.items():
        if is_routed(name):
            continue
        m = _ADAPTER.match(name)
        key = f"{m.group(1)}.lora_{m.group(2)}.weight" if m else name
        if m and m.group(2) == "A":
            adapted.append(m.group(1))
        out[f"base_model.model.{key}"] = t.contiguous()
    carried = trained_biases(plan, src)
    if carried or (f.whole_params and plan.model.config["model_type"] == "deepseek_v3"):
        # peft saves a modules_to_save copy of the whole router, so its loader expects V3's routing-bias
        # buffer too: the one training.balance aux_free moved, else the base's. A run that moved the
        # bias without training the router whole ships the base's router weight beside it.
        base = _base_source(plan)
        routers = {n.removesuffix(f".{BIAS}") for n in carried}
        routers |= {n.removesuffix(".weight") for n in tensors if n.endswith(".mlp.gate.weight")}
        for router in sorted(routers):
            out.setdefault(f"base_model.model.{router}.weight", base(f"{router}.weight").contiguous())
            bias = carried.get(f"{router}.{BIAS}")
            bias = base(f"{router}.{BIAS}") if bias is None else bias
            out[f"base_model.model.{router}.{BIAS}"] = bias.float().contiguous()
    config = adapter_config(f, adapted, router_copy=bool(carried))
    config["base_model_name_or_path"] = plan.model.path or plan.model.name
    (work / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(out, str(work / "adapter_model.safetensors"), metadata={"format": "pt"})


def trained_biases(plan: Plan, src: Path) -> dict[str, torch.Tensor]:
    """Transformers name -> the routing bias the checkpoint carries (dskit/train/checkpoints/routing_bias.py),
    where the run moved it (training.balance aux_free); empty where the base's stays."""
    if plan.model.balance != "aux_free":
        return {}
    from dskit.train.checkpoints import routing_bias

    saved = routing_bias.read(src)
    if not saved:
        raise RuntimeError(
            f"{src} holds no routing bias although the run updated it (training.balance aux_free)"
        )
    return {routing_bias.hf_name(n): t for n, t in saved.items()}


def _routed(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`model.layers.N.mlp` -> {"A1": [E, r, h], "B1": [E, I, r], ...}: the checkpoint's routed adapters."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = CHECKPOINT_NAME.match(name)
        if m:
            layer, proj, ab = m.groups()
            out.setdefault(layer, {})[f"{ab}{proj[1]}"] = t.float()
    return out


def peft_routed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routed adapters under peft's keys and in its ParamWrapper layout (the module docstring)."""
    import torch

    out = {}
    for layer, w in _routed(tensors).items():
        E, r = w["A1"].shape[:2]
        inter = w["B1"].shape[1]
        a = torch.cat([w["A1"], w["A3"]], dim=1)  # [E, 2r, h]: gate's rows, then up's
        b = torch.zeros(E, 2 * inter, 2 * r)  # block-diagonal: gate's outputs read gate's rank only
        b[:, :inter, :r], b[:, inter:, r:] = w["B1"], w["B3"]
        for proj, (a_, b_) in {"gate_up_proj": (a, b), "down_proj": (w["A2"], w["B2"])}.items():
            key = f"{layer}.{_PEFT_ROUTED_KEY[proj]}"
            dtype = tensors[f"{layer}.experts.w1.lora_A"].dtype
            out[f"{key}.lora_A.weight"] = a_.reshape(-1, a_.shape[-1]).to(dtype)  # [E R, in], expert-major
            out[f"{key}.lora_B.weight"] = b_.permute(1, 2, 0).reshape(b_.shape[1], -1).to(dtype)  # [out, R E]
    return out


def _routed_delta(w: dict[str, torch.Tensor], proj: str, scale: float) -> torch.Tensor:
    """scale * B A per expert in transformers' fused layout: gate_up_proj [E, 2I, h] or down_proj [E, h, I]."""
    import torch

    if proj == "down_proj":
        return scale * torch.bmm(w["B2"], w["A2"])
    return scale * torch.cat([torch.bmm(w["B1"], w["A1"]), torch.bmm(w["B3"], w["A3"])], dim=1)


def merged_source(plan: Plan, src: Path) -> TensorOf:
    """name, shape, dtype -> the merged model's tensor (see the module docstring)."""
    import torch

    f = plan.finetune
    assert f is not None
    tensors = trained(src)
    scale = f.alpha / f.r
    base = _base_source(plan)
    routed = _routed(tensors)
    carried = trained_biases(plan, src)

    def tensor_of(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name in tensors:  # trained whole (the router)
            return tensors[name].to(dtype).reshape(shape).contiguous()
        if name in carried:  # the routing bias as training.balance aux_free moved it, fp32
            return carried[name].float().reshape(shape).contiguous()
        t = base(name)
        module = name.removesuffix(".weight")
        a = tensors.get(f"{module}.lora_A.default.weight")
        if a is not None:
            b = tensors[f"{module}.lora_B.default.weight"]
            t = t.float() + scale * (b.float() @ a.float())
        fused = _FUSED.match(name)
        if fused and fused.group(1).removesuffix(".experts") in routed:
            t = t.float() + _routed_delta(
                routed[fused.group(1).removesuffix(".experts")], fused.group(2), scale
            )
        if tuple(t.shape) != shape:
            raise RuntimeError(f"{name}: the base has {tuple(t.shape)}, the model expects {shape}")
        keep = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        return t.to(keep).contiguous()

    return tensor_of


def _base_source(plan: Plan) -> Callable[[str], torch.Tensor]:
    """name -> the base model's tensor: from model.path one tensor at a time, or the random init rebuilt."""
    if plan.model.path:
        from safetensors import safe_open

        from dskit.formats.hf_checkpoint import check_checkpoint, fp8_format

        check_checkpoint(plan.model.path)  # the plan checked it; the directory may have changed since
        files = _files_of(Path(plan.model.path))
        fmt = fp8_format(plan.model.path)  # an FP8 base (either base_precision) merges dequantised

        def raw(name: str) -> torch.Tensor:
            if name not in files:
                raise RuntimeError(f"{plan.model.path} has no tensor {name}")
            with safe_open(str(files[name]), framework="pt") as fh:
                return fh.get_tensor(name)

        def read(name: str) -> torch.Tensor:
            if fmt is None or name not in fmt.weights:
                return raw(name)
            import torch

            from dskit.train.fp8.blocks import dequantize_blocks

            # DeepSeek's rule, in float32 and rounded to bf16: the weight the trainer computed with
            return dequantize_blocks(raw(name), raw(fmt.scale_of(name)), fmt.block, torch.bfloat16)

        return lambda name: _fused(name, read, plan.model.config["n_routed_experts"])
    if plan.model.params_total > REBUILD_MAX_PARAMS:
        raise SpecError(
            "model.path",
            f"this LoRA run trained on a random-init base of {plan.model.params_total / 1e9:.1f}B parameters, "
            "too large to rebuild here for a merge; export --adapter-only, or train from model.path",
        )
    return _rebuilt_init(plan).__getitem__


#: transformers' fused routed experts; published checkpoints (and save_pretrained) keep one tensor per
#: expert and projection, which transformers fuses as it loads (gate before up, experts stacked)
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _fused(name: str, read: Callable[[str], torch.Tensor], n_experts: int) -> torch.Tensor:
    """`name` in transformers' layout from per-expert tensors where the checkpoint has those."""
    import torch

    m = _FUSED.match(name)
    if m is None:
        return read(name)
    experts, proj = m.groups()
    try:
        return read(name)  # already fused on disk
    except RuntimeError:
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        return torch.stack(
            [torch.cat([read(f"{experts}.{e}.{p}.weight") for p in parts]) for e in range(n_experts)]
        )


def _files_of(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (an index's map, or the single file)."""
    from dskit.formats.hf_checkpoint import INDEX, SINGLE, read_index

    if (root / INDEX).is_file():
        return {n: root / f for n, f in read_index(root / INDEX).items()}
    from safetensors import safe_open

    with safe_open(str(root / SINGLE), framework="pt") as fh:
        return {n: root / SINGLE for n in fh.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def _rebuilt_init(plan: Plan) -> dict[str, torch.Tensor]:
    """The random init the run started from, built whole on the CPU the way the trainer builds it."""
    import torch

    from dskit.train.model import build_model, torch_dtype

    model = build_model(
        plan.model,
        attention="sdpa",
        dtype=torch_dtype(plan.parallel.precision),
        seed=plan.run.seed,
        ckpt_every=0,
        deepspeed_config={"zero_optimization": {"stage": 0}},  # whole, no zero.Init
        device=torch.device("cpu"),
    )
    return {n: t.detach() for n, t in model.state_dict().items()}
