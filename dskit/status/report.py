"""`dskit report RUN_DIR`: PNG plots and one self-contained HTML page from a run's metrics.jsonl.

Reads only files (run.yaml, OUTPUT_DIR/metrics.jsonl, OUTPUT_DIR/launch-env.json), so it works on a
finished run, a running one (the file is appended per log step) and one that was preempted and
resumed. A resumed run re-logs the steps after its last checkpoint: the later record of a step
replaces the earlier one, so the curves are one run. Restarts are drawn where the step went backwards
(a hard kill) or where a resumed process marked its first record with `resumed_from` (a clean stop).
matplotlib is imported here only (the `report` extra), with the Agg backend: no display is needed.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dskit.errors import SpecError
from dskit.io import bounded_read
from dskit.launch.contract import LAUNCH_ENV_FILE, METRICS_FILE, RUN_YAML
from dskit.plan.balancing import describe as describe_balance
from dskit.train.progress import throughput_text

#: one metrics record: the losses, rates and per-expert loads of one step (DeepSeek-V3: ~15k numbers)
MAX_METRICS_LINE = 4 << 20
#: the launch environment rank 0 recorded: a few hundred variables
MAX_LAUNCH_ENV = 1 << 20
DPI = 100


@dataclass
class Series:
    """The run's log records, one per step (later records win), and the steps where it restarted."""

    records: list[dict[str, Any]]
    restarts: list[int] = field(default_factory=list)  # first step logged by each resumed segment

    def column(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]


def read_launch_env(path: Path) -> dict | None:
    """launch-env.json within its limit; SpecError naming it when it is damaged."""
    try:
        env = bounded_read.read_json(path, limit=MAX_LAUNCH_ENV, what=LAUNCH_ENV_FILE)
    except bounded_read.TooLarge as e:
        raise SpecError(str(path), e.reason) from None
    except (OSError, ValueError) as e:
        raise SpecError(str(path), f"unreadable (not JSON: {e})") from None
    if not isinstance(env, dict):
        raise SpecError(str(path), "is not a mapping of variable names to values")
    return env


def read_metrics(path: Path) -> Series:
    """Parse metrics.jsonl. A torn last line (a run killed mid-write, or still writing) is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    restarts: list[int] = []
    last = 0
    try:
        records = list(bounded_read.iter_jsonl(path, line_limit=MAX_METRICS_LINE, what=METRICS_FILE))
    except bounded_read.TooLarge as e:
        raise SpecError(str(path), e.reason) from None
    except OSError as e:
        raise SpecError(str(path), f"cannot read it: {e.strerror or e}") from None
    for rec in records:
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        # a hard kill resumes from an older checkpoint (the step goes backwards); a clean stop resumes
        # from its own step, which the trainer marks as `resumed_from`
        if rec["step"] <= last or rec.get("resumed_from"):
            restarts.append(rec["step"])
        last = rec["step"]
        by_step[rec["step"]] = rec
    return Series([by_step[s] for s in sorted(by_step)], restarts)


@dataclass
class RunFiles:
    run_dir: Path
    output_dir: Path
    plan: Any | None  # dskit.plan.schema.Plan when run.yaml is there


def locate(run_dir: str | Path) -> RunFiles:
    """RUN_DIR is a rendered run dir (run.yaml points at the output dir) or an output dir itself (a
    copy of a cluster run's outputs, with metrics.jsonl in it)."""
    from dskit.plan.schema import load_plan

    d = Path(run_dir)
    if (d / RUN_YAML).is_file():
        plan = load_plan(d / RUN_YAML)
        out = Path(plan.run.output_dir)
        if not (out / METRICS_FILE).is_file() and (d / METRICS_FILE).is_file():
            out = d  # outputs copied next to run.yaml
        return RunFiles(d, out, plan)
    if (d / METRICS_FILE).is_file():
        return RunFiles(d, d, None)
    raise SpecError(str(d), f"no {RUN_YAML} or {METRICS_FILE} here: give a run directory")


# --------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib's pyplot on the Agg backend (the `report` extra; every dskit plot goes through here)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: a login node or CI has no display
    import matplotlib.pyplot as plt

    return plt


def _restart_lines(ax, s: Series, color: str = "tab:red") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for i, step in enumerate(s.restarts):
        ax.axvline(step, color=color, ls=":", lw=1.5, label="restart (resumed)" if i == 0 else None)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def plot_loss(s: Series, path: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    a1.plot(*s.column("loss"), color="tab:blue", lw=1.5, label="cross-entropy")
    a1.set_ylabel("loss (nats/token)")
    a1.set_title("Training loss")
    a2.plot(*s.column("aux_loss"), color="tab:orange", lw=1.5, label="balance (aux) loss")
    a2.set_ylabel("aux loss (summed over MoE layers)")
    a2.set_xlabel("step")
    for ax in (a1, a2):
        _restart_lines(ax, s)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    return _save(fig, path)


def plot_throughput(s: Series, path: Path) -> Path:
    return _save(throughput_figure(s), path)


def throughput_figure(s: Series):
    """Tokens/s per GPU (real tokens; computed, padding included) over MFU."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    steps, real = s.column("real_tokens_per_s_per_gpu")
    if real:
        a1.plot(steps, real, color="tab:green", lw=1.5, label="real tokens")
    # its own colour and dashes, drawn on top: with full rows the two are one curve, and a faint line
    # beneath the real tokens' did not show at all
    a1.plot(
        *s.column("tokens_per_s_per_gpu"),
        color="tab:brown",
        lw=1.2,
        ls="--",
        zorder=3,
        label="computed (with padding)",
    )
    a1.legend(loc="best")
    a1.set_ylabel("tokens/s per GPU")
    a1.set_title("Throughput and model FLOPs utilisation")
    steps, mfu = s.column("mfu")
    if mfu:
        a2.plot(steps, [100 * m for m in mfu], color="tab:purple", lw=1.5)
    else:
        a2.text(
            0.5,
            0.5,
            "no MFU: the GPU profile has no peak FLOP/s",
            ha="center",
            va="center",
            transform=a2.transAxes,
            color="gray",
        )
        a2.set_yticks([])  # an empty 0..1 scale would read as a measured 0% MFU
    a2.set_ylabel("MFU (%)")
    a2.set_xlabel("step")
    for ax in (a1, a2):
        _restart_lines(ax, s)
        ax.grid(alpha=0.3)
    return fig


def plot_memory(s: Series, path: Path, estimate_gib: float | None, capacity_gib: float | None) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(*s.column("peak_alloc_gib"), color="tab:blue", lw=1.5, label="peak allocated")
    ax.plot(*s.column("peak_reserved_gib"), color="tab:cyan", lw=1.5, ls="--", label="peak reserved")
    if estimate_gib is not None:
        ax.axhline(estimate_gib, color="tab:orange", lw=1.2, label=f"plan estimate ({estimate_gib:.3g} GiB)")
    if capacity_gib is not None:
        ax.axhline(capacity_gib, color="tab:red", lw=1.2, label=f"GPU usable ({capacity_gib:.3g} GiB)")
    _restart_lines(ax, s)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("memory per rank (GiB)")
    ax.set_title("Peak memory (rank 0; on CPU: process peak RSS)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_lr(s: Series, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(*s.column("lr"), color="tab:gray", lw=1.5)
    _restart_lines(ax, s)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning-rate schedule")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def balance_text(rec: dict[str, Any]) -> str | None:
    """A log record's expert balance in words, for the report's state table and `dskit status`: the
    worst layer's max/mean load, and the routing bias's widest spread where the model has one."""
    worst = rec.get("expert_load_max_over_mean")
    if worst is None:
        return None
    per_layer = rec.get("expert_load_per_layer") or []
    text = f"max/mean load {worst:.2f} (worst of {len(per_layer)} MoE layers; 1 = balanced)"
    spread = rec.get("expert_bias_spread")
    if spread is not None:
        text += f", routing-bias spread {spread:.4g} (max - min, widest layer)"
    return text


def plot_expert_load(s: Series, path: Path) -> Path | None:
    """Left: tokens per expert / the layer's mean (1 = balanced), layer x expert, at the latest step
    with counts. Middle: max/mean per layer over steps (recorded since before per-expert counts).
    Right, for models with a routing bias: its spread (max - min) per layer over steps, which
    training.balance aux_free moves against the load."""
    with_counts = [r for r in s.records if r.get("expert_counts")]
    steps, per_layer = s.column("expert_load_per_layer")
    if not with_counts and not per_layer:
        return None
    bias_steps, spreads = s.column("expert_bias_spread_per_layer")
    plt = pyplot()
    if spreads:
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    else:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.3, 1]})
    from matplotlib.ticker import MaxNLocator

    for ax in (a1, a2, *((a3,) if spreads else ())):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # layer indices
    if with_counts:
        rec = with_counts[-1]
        rows = [[c / max(sum(row) / len(row), 1e-9) for c in row] for row in rec["expert_counts"]]
        hi = max(2.0, max(max(r) for r in rows))
        im = a1.imshow(rows, aspect="auto", cmap="RdBu_r", vmin=0, vmax=hi, interpolation="nearest")
        fig.colorbar(im, ax=a1, label="tokens / layer mean (1 = balanced)")
        a1.xaxis.set_major_locator(MaxNLocator(integer=True))
        a1.set_xlabel("expert")
        a1.set_ylabel("MoE layer")
        a1.set_title(f"Expert load at step {rec['step']}")
    else:
        a1.text(
            0.5,
            0.5,
            "no per-expert counts in these metrics",
            ha="center",
            va="center",
            transform=a1.transAxes,
            color="gray",
        )
        a1.set_axis_off()
    if per_layer:
        _over_steps(a2, per_layer, steps, s, "magma", 1.0, "max / mean tokens per expert", "cyan")
        a2.set_title("Worst-expert load over steps")
    if spreads:
        _over_steps(a3, spreads, bias_steps, s, "viridis", 0.0, "routing bias max - min", "red")
        a3.set_title("Routing-bias spread over steps")
    return _save(fig, path)


# --------------------------------------------------------------------------- page


def _over_steps(
    ax, rows: list[list[float]], steps: list[int], s: Series, cmap: str, vmin: float, label: str, color: str
) -> None:
    """A [step][layer] series as a layer-by-step heatmap on `ax`, restarts marked."""
    cols = list(zip(*rows, strict=False))  # [layer][step]
    im = ax.imshow(
        cols,
        aspect="auto",
        cmap=cmap,
        vmin=vmin,
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(cols) - 0.5, -0.5),
    )
    ax.figure.colorbar(im, ax=ax, label=label)
    _restart_lines(ax, s, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("MoE layer")


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td><code>{html.escape(str(v))}</code></td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></figure>'


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def _count(n: int) -> str:
    """Parameter counts at a glance: 15.7 B, 219.1 K (a tiny test model would read 0.00 B)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _plan_rows(plan: Any) -> list[tuple[str, Any]]:
    if plan is None:
        return [("plan", "no run.yaml next to these metrics")]
    p, h, o = plan.parallel, plan.hardware, plan.optim
    return [
        ("summary", plan.summary()),
        (
            "model",
            f"{plan.model.name} ({_count(plan.model.params_total)} total, "
            f"{_count(plan.model.params_active)} active parameters)",
        ),
        ("hardware", f"{h.nodes} x {h.procs_per_node} {h.gpu} (world {h.world_size})"),
        (
            "parallel",
            f"EP {p.ep_size}, micro-batch {p.micro_batch}, grad accum {p.grad_accum}, "
            f"seq {p.seq_len}, {p.precision}",
        ),
        ("optimizer", f"{o.steps} steps, lr {o.lr:g} -> {o.min_lr:g}, warmup {o.warmup_steps}"),
        ("balancing", describe_balance(plan)),
        ("memory estimate", f"{plan.memory.get('total_gib')} GiB/GPU"),
        ("output dir", plan.run.output_dir),
    ]


CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:.25em .6em;"
    "text-align:left;vertical-align:top}th{background:#f4f4f4}img{max-width:100%}figure{margin:1em 0}"
)


def _throughput_rows(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The real tokens and what was computed, padding included, each a row of its own, as the plot
    draws each its own line."""
    real, rows, eff = (
        rec.get(k) for k in ("real_tokens_per_s_per_gpu", "tokens_per_s_per_gpu", "packing_efficiency")
    )
    if real is None or rows is None:  # a record of before real tokens were counted: one figure
        return [("tokens/s/GPU", throughput_text(rec))]
    full = "" if eff is None else f" (rows {eff:.0%} full)"
    return [
        ("tokens/s/GPU, real tokens", f"{real:,.0f}"),
        ("tokens/s/GPU computed, with padding", f"{rows:,.0f}{full}"),
    ]


def write_html(
    path: Path, title: str, s: Series, plan: Any, launch_env: dict | None, images: list[tuple[Path, str]]
) -> Path:
    last = s.records[-1]
    total = plan.optim.steps if plan is not None else None
    state = [
        ("latest step", f"{last['step']}" + (f" / {total}" if total else "")),
        ("loss", _num(last.get("loss"))),
        *_throughput_rows(last),
        *((("expert balance", b),) if (b := balance_text(last)) else ()),
        ("restarts (first step logged after each)", ", ".join(map(str, s.restarts)) or "none"),
    ]
    env_rows = sorted((launch_env or {}).items()) or [(LAUNCH_ENV_FILE, "not written yet")]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        "<h2>State</h2>",
        _table(state),
        *(_img(p, alt) for p, alt in images),
        "<h2>Plan</h2>",
        _table(_plan_rows(plan)),
        "<h2>Launch contract (rank 0's environment)</h2>",
        _table(env_rows),
        "</body></html>",
    ]
    path.write_text("\n".join(parts))
    return path


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs and index.html into out_dir (default RUN_DIR/report); returns the files."""
    rf = locate(run_dir)
    metrics = rf.output_dir / METRICS_FILE
    if not metrics.is_file():
        raise SpecError(str(metrics), "no metrics yet: the run has not reached its first log step")
    s = read_metrics(metrics)
    if not s.records:
        raise SpecError(str(metrics), "empty: the run has not reached its first log step")
    env_file = rf.output_dir / LAUNCH_ENV_FILE  # read before anything is made: a damaged one writes nothing
    launch_env = read_launch_env(env_file) if env_file.is_file() else None
    out = Path(out_dir) if out_dir else rf.run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError("-o", f"cannot create {out}: {e.strerror or e}") from None
    plan = rf.plan
    estimate = plan.memory.get("total_gib") if plan is not None else None
    capacity = plan.hardware.usable_memory_gib if plan is not None else None
    images = [
        (plot_loss(s, out / "loss.png"), "loss and aux loss vs step"),
        (plot_throughput(s, out / "throughput.png"), "tokens/s per GPU and MFU vs step"),
        (plot_memory(s, out / "memory.png", estimate, capacity), "peak memory vs plan and GPU"),
    ]
    experts = plot_expert_load(s, out / "expert_load.png")
    if experts:
        images.append((experts, "expert load and routing-bias spread heatmaps"))
    images.append((plot_lr(s, out / "lr.png"), "learning rate vs step"))
    title = f"dskit report: {plan.name if plan is not None else rf.run_dir.name}"
    page = write_html(out / "index.html", title, s, plan, launch_env, images)
    return [p for p, _ in images] + [page]
