"""`dskit plan --explain` and `--plot`: every candidate the planner weighed, and why the winner won.

Reads a `search.Search` (dskit/plan/search.py); computes nothing of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dskit.calibrate import scales
from dskit.calibrate.calibration import EXCHANGE, Calibration, echo
from dskit.plan.adapters import Tuning
from dskit.plan.balancing import describe as describe_balance
from dskit.plan.links import Group
from dskit.plan.schema import Plan
from dskit.plan.search import Row, Search

COLUMNS = (
    ("ZeRO", 4),
    ("EP", 3),
    ("mbs", 4),
    ("accum", 5),
    ("ckpt", 4),
    ("offload", 7),
    ("states", 7),
    ("work", 6),
    ("activ", 6),
    ("loss", 6),
    ("GiB/GPU", 8),
    ("build", 6),
    ("host/node", 9),
    ("step s", 7),
    ("tok/s/GPU", 9),
    ("MFU", 5),
)


def row_dict(r: Row) -> dict[str, Any]:
    c, f = r.candidate, r.fit
    return {
        "zero_stage": c.zero_stage,
        "ep_size": c.ep_size,
        "micro_batch": c.micro_batch,
        "grad_accum": r.grad_accum,
        "activation_checkpointing": c.ckpt_every,
        "offload_optimizer": c.offload,
        "memory": {
            **f.steady.as_dict(),
            "construction_gib": round(f.construction.total_gib, 2),
            "host_gib": round(f.host.total_gib, 2),
        },
        "fits": r.fits,
        "speed": r.speed.as_dict() if r.speed else None,
        "verdict": r.verdict,
    }


def _cells(r: Row) -> list[str]:
    c, f, e = r.candidate, r.fit, r.fit.steady
    s = r.speed
    return [
        str(c.zero_stage),
        str(c.ep_size),
        str(c.micro_batch),
        str(r.grad_accum),
        str(c.ckpt_every) if c.ckpt_every else "-",
        "cpu" if c.offload else "-",
        f"{e.states_gib:.1f}",
        f"{e.working_set_gib:.1f}",
        f"{e.activations_gib:.1f}",
        f"{e.logits_gib:.1f}",
        f"{e.total_gib:.1f}",
        f"{f.construction.total_gib:.1f}",
        f"{f.host.total_gib:.0f}",
        f"{s.step_s:.3f}" if s else "?",
        f"{s.tokens_per_s / 1000:.1f}k" if s else "?",
        f"{s.mfu:.0%}" if s else "?",
    ]


def table(plan: Plan, found: Search) -> str:
    """The candidate table: the chosen row first, then the other fits by speed, then what does not fit."""
    setting = found.chosen.fit.setting
    head = [
        f"{plan.summary()}",
        f"candidates: {len(found.rows)} (fit: {sum(r.fits for r in found.rows)}); GPU limit "
        + (f"{setting.gpu_limit:.1f} GiB" if setting.gpu_limit else "none (cpu)")
        + ", host limit "
        + (f"{setting.host_limit:.0f} GiB/node" if setting.host_limit else "unknown"),
        "memory in GiB per GPU (states, working set: ZeRO-3's gathered layers, ZeRO-1/2's buckets and boundary "
        "gradient copy; activations, loss, total; build = construction peak); host = RAM per node; step time "
        "predicted by dskit/plan/speed.py",
        *lora_terms(plan, setting.tuning),
        describe_balance(plan),
        "",
    ]
    widths = [w for _, w in COLUMNS]
    lines = [" ".join(f"{n:>{w}}" for n, w in COLUMNS) + "  verdict"]
    for r in found.rows:
        lines.append(" ".join(f"{x:>{w}}" for x, w in zip(_cells(r), widths, strict=True)) + f"  {r.verdict}")
    tail = []
    s = found.chosen.speed
    if s:
        tail.append("chosen, where the step goes: " + step_breakdown(s))
    if s and s.unknown:
        tail.append("not counted: " + "; ".join(s.unknown))
    if s and s.sources:
        tail.append("where each term's rate comes from:")
        tail += [f"  {term}: {source}" for term, source in s.sources]
    if found.calibration is not None:
        tail += calibration_lines(found.calibration)
    tail += precision_lines(plan, s, found.precision_alternative)

    if found.unforced_best is not None:
        tail.append(
            f"without the overrides the planner would take: {found.unforced_best.candidate.describe()}"
        )
    return "\n".join(head + lines + ([""] + tail if tail else []))


def plot(plan: Plan, found: Search, path: Path, top: int = 16) -> Path:
    """Memory breakdown (stacked bars, the limit as a line) and predicted tokens/s of the candidates:
    the fits by speed, then the nearest misses, at most `top` bars."""
    from dskit.status.report import pyplot

    plt = pyplot()

    rows = found.rows[:top]
    labels = [
        f"EP{r.candidate.ep_size} mb{r.candidate.micro_batch}x{r.grad_accum}"
        + (" ckpt" if r.candidate.ckpt_every else "")
        + (" off" if r.candidate.offload else "")
        for r in rows
    ]
    x = range(len(rows))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(rows) + 3), 7), sharex=True)
    bottom = [0.0] * len(rows)
    for key, color in (
        ("states_gib", "tab:blue"),
        ("working_set_gib", "tab:cyan"),
        ("activations_gib", "tab:orange"),
        ("logits_gib", "tab:red"),
        ("overhead_gib", "tab:gray"),
    ):
        vals = [getattr(r.fit.steady, key) for r in rows]
        a1.bar(
            x,
            vals,
            bottom=bottom,
            color=color,
            label={"logits_gib": "loss"}.get(key, key.removesuffix("_gib").replace("_", " ")),
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    limit = found.chosen.fit.setting.gpu_limit
    if limit:
        a1.axhline(limit, color="black", ls="--", lw=1, label=f"limit {limit:.0f} GiB")
    a1.set_ylabel("GiB per GPU (steady state)")
    a1.set_title(
        f"{plan.model.name} on {plan.hardware.nodes}x{plan.hardware.procs_per_node} {plan.hardware.gpu}"
    )
    a1.legend(loc="upper right", fontsize=8)
    speeds = [r.speed.tokens_per_s / 1000 if r.speed and r.fits else 0.0 for r in rows]
    colors = [
        "tab:green" if r.verdict == "chosen" else ("tab:olive" if r.fits else "lightgray") for r in rows
    ]
    a2.bar(x, speeds, color=colors)
    a2.set_ylabel("predicted k tokens/s/GPU (0: does not fit)")
    a2.set_xticks(list(x), labels, rotation=45, ha="right", fontsize=8)
    for ax in (a1, a2):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")  # renamed into place: no half-written image
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def step_breakdown(s) -> str:
    """The winner's predicted seconds per step by term (dskit/plan/speed.py's names)."""
    terms = [
        ("compute", s.compute_s),
        ("per-layer GPU", s.layer_gpu_s),
        ("ZeRO collectives", s.collectives_s),
        ("ZeRO-2 gradient copies", s.grad_copy_s),
        ("all-to-all", s.all_to_all_s),
        ("optimizer", s.optimizer_s),
        ("once-per-step collectives and copies", s.boundary_s),
    ]
    gpu = ", ".join(f"{n} {v:.3f} s" for n, v in terms if v)
    beside = f"the GPU's {s.gpu_s:.3f} s" + (", its optimizer in it" if s.optimizer_overlapped else "")
    return f"{gpu}; host {s.host_s:.3f} s beside {beside} ({s.bound}-bound); step {s.step_s:.3f} s"


#: the calibration file's names of what it times, as the step-time model's terms call them
OP_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", EXCHANGE: "AutoEP's exchange"}


def precision_lines(plan: Plan, chosen, alternative) -> list[str]:
    """bf16 beside FP8 at the chosen candidate: the plan's FP8 beside bf16, or what `training.fp8=on` would
    give on a GPU that has FP8 (dskit/plan/fp8_training.py; FP8 changes the numerics: docs/trainer.md)."""
    if alternative is None or chosen is None:
        return []
    other, speed = alternative
    p = plan.parallel
    here = (
        f"FP8 {p.fp8} on {', '.join(p.fp8_linears) or 'no linear'}{', the routed experts' if p.fp8_experts else ''}"
        if p.fp8
        else "bf16"
    )
    line = f"precision: {here}: {chosen.tokens_per_s:,.0f} tokens/s/GPU predicted"
    if speed is None:
        return [line + f"; {other}: not predicted"]
    line += f"; {other}: {speed.tokens_per_s:,.0f} ({speed.tokens_per_s / chosen.tokens_per_s:.2f}x)"
    if not p.fp8:
        line += "; FP8 changes the numerics (docs/trainer.md, 'FP8 training')"
    return [line]


def calibration_lines(cal: Calibration) -> list[str]:
    """Every figure the calibration holds, as the plan read it, beside the reference machine's reading
    of the same probe where its term is scaled by their ratio (dskit/calibrate/scales.py): the sources
    above say which term took which."""
    kind = scales.kind_of(cal.hardware.gpu)
    ref, machine = scales.reference(kind), scales.MACHINES[kind]
    h, here, there = cal.hardware, cal.compute, ref.compute
    out = [
        f"what the calibration measured ({h.nodes}x{h.procs_per_node} {h.gpu}, "
        + echo(f"{h.device}, {h.backend}, torch {h.torch}, {cal.created}")
        + "):"
    ]
    for op, fits in cal.collectives.items():
        for key, f in fits.items():
            sizes = [b for b, _ in f.points]  # none in a file written by hand: the fit alone
            group = Group(*(int(x) for x in key.split("x")))
            fitted = (
                f" (fitted to {len(sizes)} sizes, {_size(min(sizes))} to {_size(max(sizes))})"
                if sizes
                else ""
            )
            out.append(
                f"  {OP_NAMES.get(op, op)} over {key} ({group.describe()}): {f.bus_gbs:.3g} GB/s, "
                f"{_duration(f.latency_s)} a call{fitted}"
            )

    def against(text: str | None, reference: str | None) -> str:
        if text is None:
            return "not measured"
        return text + ("" if reference is None else f"; {machine}: {reference}")

    def flops(x: float | None) -> str | None:
        return None if x is None else f"{x:.3g} TFLOP/s" if x >= 1 else f"{x * 1e3:.3g} GFLOP/s"

    def per_pass(x: float | None) -> str | None:
        return None if x is None else f"{_duration(x)} a layer pass"

    def adam(a) -> str | None:
        return None if a is None else f"{a.core_s_per_bparam:.3g} core-s per billion parameters"

    adam_text = adam(cal.cpu_adam)
    if adam_text and cal.cpu_adam is not None:
        adam_text += f", {cal.cpu_adam.ranks} rank(s) x {cal.cpu_adam.threads_per_rank} thread(s) at once"
    out += [
        f"  GEMM: {against(flops(here.gemm_tflops), flops(there.gemm_tflops))}",
        f"  attention: {against(flops(here.attention_tflops), flops(there.attention_tflops))}",
        f"  host: {against(per_pass(here.host_layer_pass_s), per_pass(there.host_layer_pass_s))}",
        f"  CPU Adam: {against(adam_text, adam(ref.cpu_adam))}",
    ]
    return out


def _duration(s: float) -> str:
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _size(n: float) -> str:
    for unit, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= b:
            return f"{n / b:.3g} {unit}"
    return f"{n:.0f} B"


def lora_terms(plan: Plan, t: Tuning | None) -> list[str]:
    """What a LoRA plan counts (dskit/plan/adapters.py, docs/planner.md "LoRA"); nothing for full training."""
    f = plan.finetune
    if f is None or t is None:
        return []
    b = 1e9
    return [
        f"LoRA r {f.r}, alpha {f.alpha:g}, dropout {f.dropout:g} on {', '.join(f.targets)}: trainable T = "
        f"{t.trainable / b:.3f} B ({t.adapters / b:.3f} B adapters + {t.router / b:.3f} B router), frozen F = "
        f"{t.frozen / b:.2f} B ({f.base_precision}: {t.other_bytes:.3f} B/weight non-expert, {t.expert_bytes:.3f} "
        "B/weight experts)",
        "  states: ZeRO-3 (bytes(F) + 16 T) / world; ZeRO-1/2 bytes(local F) + 2 T + grads(T) + 12 T / world; "
        "gradient buckets and the optimizer's pass over T only; compute "
        f"{plan.model.flops_per_token / 1e9:.2f} GFLOP/token (4 x active base: no weight-gradient GEMMs for "
        "frozen weights; 6 x trainable; attention)"
        + (
            f"; fp8 dequantised in flight: largest linear {t.dequant_bytes / 2**30:.2f} GiB, one MoE layer's "
            f"local experts {t.expert_dequant_bytes / plan.parallel.ep_size / 2**30:.2f} GiB; construction "
            "holds only the rank's share, in FP8, from the first tensor (built from the meta device, ZeRO-1/2 only)"
            if t.fp8
            else ""
        ),
        *_routed_terms(plan, t),
    ]


def _routed_terms(plan: Plan, t: Tuning) -> list[str]:
    """The routed experts' adapters (dskit/train/lora/routed.py): their count, and what their weight delta costs."""
    if not t.routed_adapters:
        return []
    ep = plan.parallel.ep_size
    return [
        f"  routed experts: {t.routed_adapters / 1e9:.3f} B adapters (r (3 h + 3 I) per expert, all experts; "
        f"{t.routed_adapters / ep / 1e9:.4f} B per rank at EP {ep}), applied as W + alpha/r B A: "
        f"+{2 * t.active_routed / 1e9:.2f} GFLOP/token for the routed weight-gradient GEMMs; each MoE layer "
        f"not checkpointed holds its local W_eff, {t.routed_delta_bytes / ep / 2**30:.3f} GiB, for backward"
    ]
