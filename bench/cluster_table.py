"""The plan at cluster scale under today's step-time model beside the one before it, and DeepSeek-V3's
communication terms worked from first principles (no GPU: `dskit plan`'s own models only).

Commit 304388f timed each collective over its process group's shape (dskit/plan/links.py: NCCL's ring
bus bandwidth min(NVLink, r x the fabric's per-GPU rate) across nodes, ring latency per inter-node
step, the all-to-all split between the NICs and NVLink) where the model before it (5935f17) timed every
group that spans nodes at one NIC's rate; it also counts ZeRO-3's prefetch overlap only where the
rendered config lets DeepSpeed prefetch (dskit/plan/prefetch.py) and takes optimizer offload only when
it is predicted more than 15% faster (search.offload_wins).

For DeepSeek-V2-Lite, V2 and V3 at 8, 64 and 256 GPUs (8 per node, InfiniBand) of H100 and H200, with
the default spec, it prints a markdown table and writes JSON (`--out`) with each model's pick,
predicted tokens/s/GPU and communication terms (collectives_s, all_to_all_s, boundary_s). Each
model runs as a subprocess of this script with PYTHONPATH at its code: today's from `--now` (default:
this checkout), the previous one from a `git worktree` of BEFORE_COMMIT that is added under /tmp and
removed at the end (or `--before DIR`, kept). For V3 on 32 x 8 H100 it then works each communication
term of the pick by hand (bytes per pass over the group's bandwidth) beside the model's term.

    python bench/cluster_table.py --out bench/results/scale/model-cluster-table-2026-12-04.json
    python bench/cluster_table.py --now /tmp/dskit-head    # today's terms from a clean checkout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODELS = ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3")
GPUS = ("h100-80gb", "h200-141gb")
WORLDS = (8, 64, 256)
PER_NODE = 8
FABRIC = "infiniband"
#: the model before commit 304388f (plan per process group)
BEFORE_COMMIT = "5935f17"
#: the worked example: DeepSeek-V3 on 32 x 8 H100
ARITH = ("deepseek-v3", "h100-80gb", 256)
#: how far the model's term may be from the first-principles arithmetic (the brief's goal)
GOAL = 0.30
COMM_TERMS = ("collectives_s", "all_to_all_s", "boundary_s")


def _sets(model: str, gpu: str, world: int) -> list[str]:
    return [
        f"model.preset={model}",
        f"hardware.gpu={gpu}",
        f"hardware.gpus_per_node={PER_NODE}",
        f"hardware.nodes={world // PER_NODE}",
        f"network.fabric={FABRIC}",
    ]


def _plan(model: str, gpu: str, world: int):
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    return build_plan_searched(load_spec(None, _sets(model, gpu, world), {}))[0]


# ---- run inside the subprocess, with the code under test on PYTHONPATH ----


def rows_here() -> dict:
    """Every cell under the dskit that PYTHONPATH gives (the subprocess's half)."""
    import dskit
    from dskit.errors import SpecError

    rows = []
    for model in MODELS:
        for gpu in GPUS:
            for world in WORLDS:
                row: dict = {"model": model, "gpu": gpu, "gpus": world}
                try:
                    plan = _plan(model, gpu, world)
                except SpecError as e:
                    row["refused"] = f"{e.field}: {e.message}".splitlines()[0]
                    rows.append(row)
                    continue
                p, s = plan.parallel, plan.speed or {}
                row.update(
                    zero_stage=p.zero_stage,
                    ep_size=p.ep_size,
                    micro_batch=p.micro_batch,
                    grad_accum=p.grad_accum,
                    activation_checkpointing=p.activation_checkpointing,
                    offload_optimizer=p.offload_optimizer,
                    memory_gib=plan.memory["total_gib"],
                    tokens_per_s_per_gpu=s.get("tokens_per_s_per_gpu"),
                    step_s=s.get("step_s"),
                    **{k: s.get(k, 0.0) for k in COMM_TERMS},
                    sources=s.get("sources", {}),
                )
                rows.append(row)
    return {"dskit": str(Path(dskit.__file__).resolve().parent.parent), "rows": rows}


def arithmetic_here() -> dict:
    """DeepSeek-V3 on 32 x 8 H100: each communication term of the pick from first principles (bytes
    per pass over the group's bandwidth), beside the model's own term (today's code only)."""
    from dskit import catalog
    from dskit.plan import links as links_
    from dskit.plan import speed
    from dskit.plan.model_math import counts

    model, gpu_name, world = ARITH
    plan = _plan(model, gpu_name, world)
    p, s = plan.parallel, plan.speed
    cfg = plan.model.config
    c = counts(cfg, p.seq_len)
    gpu = catalog.gpu(gpu_name)
    nvlink = gpu.interconnect_gbs
    nic = catalog.fabric(FABRIC).gbs_per_gpu
    L = cfg["num_hidden_layers"]
    frac = speed.checkpointed_fraction(L, p.activation_checkpointing)
    gathers_per_layer = 2 + frac  # forward, backward, and the recompute's forward
    tokens = p.micro_batch * p.seq_len
    accum = p.grad_accum
    experts = c.experts_per_layer * c.moe_layers
    non_expert = c.total - experts
    local_experts = experts / p.ep_size
    shapes = links_.groups(world, PER_NODE, p.ep_size)
    GB = 1e9

    def ring_gbs(g: links_.Group) -> float:
        return nvlink if not g.spans_nodes else min(nvlink, g.ranks_per_node * nic)

    terms = []
    # the model's own split of collectives_s: each group alone through speed._collectives_s, the
    # overlap left out (1.0 - 0) and put back below; sync counted once for the whole
    links = links_.Links(nvlink, nic)
    layout = speed.Layout(world, PER_NODE, p.ep_size)
    overlap = speed.zero3_overlap(c, layout)
    passes = L * gathers_per_layer
    model_exposed = {}
    for group, params in (("dense", non_expert), ("expert_dp", local_experts)):
        g = shapes[group]
        share = (g.size - 1) / g.size
        gbs = ring_gbs(g)
        gather_b = speed.WIRE_BYTES * params * gathers_per_layer
        reduce_b = speed.WIRE_BYTES * params
        fp = accum * (gather_b + reduce_b) * share / (gbs * GB)
        traffic = ((reduce_b, reduce_b, group),)  # _zero_groups' form: bytes per gather pass, per reduce
        unknown: list[str] = []
        per_micro, _ = speed._collectives_s(
            traffic,
            shapes,
            links,
            p.zero_stage,
            frac,
            passes,
            {"dense": L, "expert_dp": c.moe_layers},
            0.0,
            unknown,
        )
        sync = speed.SYNC_LAYER_PASS_S * passes
        modelled = accum * (per_micro - sync)
        model_exposed[group] = modelled
        terms.append(
            {
                "term": f"ZeRO-3 {group.replace('_', '-')} gathers + reduce-scatter",
                "group": g.describe(),
                "params_per_rank_b": round(params / 1e9, 3),
                "arithmetic": (
                    f"2 B x {params / 1e9:.2f} B params x ({gathers_per_layer:g} gathers + 1 reduce-scatter)"
                    f" x {accum} micro-steps x ({g.size - 1}/{g.size}) / {gbs:g} GB/s"
                    + (f" (min({nvlink:g}, {g.ranks_per_node} x {nic:g}))" if g.spans_nodes else " (NVLink)")
                ),
                "first_principles_s": round(fp, 4),
                "model_s": round(modelled, 4),
                "ratio": round(modelled / fp, 3),
                "model_note": "links.seconds: the same bytes at the same bus bandwidth plus NCCL's ring latency "
                "per call, before ZeRO-3's prefetch overlap",
            }
        )
    # the all-to-all: k copies of each token's hidden state, dispatch and combine in every pass of a MoE
    # layer; each rank sends (g-r)/g of its bytes through its NIC share and (r-1)/g over NVLink
    ep = shapes["ep"]
    if ep.size > 1:
        copies = tokens * cfg["num_experts_per_tok"] * cfg["hidden_size"] * speed.WIRE_BYTES
        ops = c.moe_layers * 2 * gathers_per_layer
        per_rank = accum * ops * copies
        net_b = per_rank * (ep.size - ep.ranks_per_node) / ep.size
        node_b = per_rank * (ep.ranks_per_node - 1) / ep.size
        fp = max(net_b / (nic * GB), node_b / (nvlink * GB))
        modelled = s["all_to_all_s"]
        terms.append(
            {
                "term": "AutoEP all-to-all (dispatch + combine)",
                "group": ep.describe(),
                "arithmetic": (
                    f"{tokens} tokens x k {cfg['num_experts_per_tok']} x hidden {cfg['hidden_size']} x 2 B"
                    f" x {ops:g} all-to-alls ({c.moe_layers} MoE layers x 2 x {gathers_per_layer:g} passes)"
                    f" x {accum} micro-steps = {per_rank / GB:.1f} GB per rank: {net_b / GB:.1f} GB over"
                    f" the NIC share at {nic:g} GB/s, {node_b / GB:.1f} GB over NVLink at {nvlink:g} GB/s"
                ),
                "first_principles_s": round(fp, 4),
                "model_s": round(modelled, 4),
                "ratio": round(modelled / fp, 3),
                "model_note": f"the same bytes at A2A_EFFICIENCY = {speed.A2A_EFFICIENCY} of the link "
                "(fitted on 2 x H200 EP 2 beside EP 1)",
            }
        )
    sync = accum * speed.SYNC_LAYER_PASS_S * passes
    whole_fp = sum(t["first_principles_s"] for t in terms if t["term"].startswith("ZeRO"))
    whole = {
        "first_principles_exposed_s": round(whole_fp, 4),
        "model_exposed_s": round(sum(model_exposed.values()), 4),
        "overlap": overlap,
        "sync_s": round(sync, 4),
        "model_collectives_s": s["collectives_s"],
        "check": round((1 - overlap) * sum(model_exposed.values()) + sync, 4),
    }
    for t in terms:
        t["within_goal"] = abs(t["ratio"] - 1) <= GOAL
    pick = (
        f"ZeRO-{p.zero_stage} EP {p.ep_size} mb {p.micro_batch}x{p.grad_accum} "
        f"ckpt/{p.activation_checkpointing}{', offload' if p.offload_optimizer else ''}"
    )
    return {
        "case": f"{model} on {world // PER_NODE} x {PER_NODE} {gpu_name}, {FABRIC}",
        "pick": pick,
        "non_expert_params_b": round(non_expert / 1e9, 3),
        "expert_params_b": round(experts / 1e9, 3),
        "terms": terms,
        "collectives": whole,
        "goal": GOAL,
    }


# ---- the parent: runs both models and prints ----


def _run(code: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{code}: {' '.join(args)} failed\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    if "dskit" in out and Path(out["dskit"]) != code.resolve():
        raise SystemExit(f"the subprocess imported dskit from {out['dskit']}, not {code}")
    return out


def _pick(r: dict | None) -> str:
    if r is None:
        return "-"
    if "refused" in r:
        return "does not fit"
    ck = {0: "no ckpt", 1: "ckpt"}.get(r["activation_checkpointing"], f"ckpt/{r['activation_checkpointing']}")
    off = ", offload" if r["offload_optimizer"] else ""
    return f"ZeRO-{r['zero_stage']} EP {r['ep_size']} mb {r['micro_batch']}x{r['grad_accum']} {ck}{off}"


def _num(r: dict | None, key: str, fmt: str = "{:.2f}") -> str:
    if r is None or "refused" in r or r.get(key) is None:
        return "-"
    return fmt.format(r[key])


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | GPUs | pick (today) | tok/s/GPU | collectives / a2a / boundary s | pick (before) | tok/s/GPU "
        "| collectives / a2a / boundary s |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        now, before = r["now"], r["before"]

        def comm(c: dict | None) -> str:
            if c is None or "refused" in c:
                return "-"
            return " / ".join(f"{c[k]:.2f}" for k in COMM_TERMS)

        lines.append(
            f"| {r['model']} | {r['gpus']} x {r['gpu'].split('-')[0].upper()} | {_pick(now)} "
            f"| {_num(now, 'tokens_per_s_per_gpu', '{:,}')} | {comm(now)} | {_pick(before)} "
            f"| {_num(before, 'tokens_per_s_per_gpu', '{:,}')} | {comm(before)} |"
        )
    return "\n".join(lines)


def arithmetic_markdown(a: dict) -> str:
    lines = [
        f"{a['case']}, pick {a['pick']}: {a['non_expert_params_b']} B non-expert parameters, "
        f"{a['expert_params_b']} B routed-expert parameters",
        "",
        "| term | group | first principles | s | model s | model / arithmetic |",
        "|---|---|---|---|---|---|",
    ]
    for t in a["terms"]:
        flag = "" if t["within_goal"] else f" (outside {a['goal']:.0%})"
        lines.append(
            f"| {t['term']} | {t['group']} | {t['arithmetic']} | {t['first_principles_s']:.3f} "
            f"| {t['model_s']:.3f} | {t['ratio']:.2f}{flag} |"
        )
    w = a["collectives"]
    lines.append(
        f"\ncollectives_s = (1 - overlap {w['overlap']:g}) x {w['model_exposed_s']:.3f} s exposed + sync "
        f"{w['sync_s']:.3f} s = {w['check']:.3f} s (the plan says {w['model_collectives_s']:.3f} s); "
        f"first principles with no overlap: {w['first_principles_exposed_s']:.3f} s"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--now", type=Path, default=REPO, help="today's code (default: this checkout)")
    ap.add_argument(
        "--before", type=Path, help=f"the previous model's checkout (default: a worktree of {BEFORE_COMMIT})"
    )
    ap.add_argument("--_rows", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_arithmetic", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._rows:
        json.dump(rows_here(), sys.stdout)
        return
    if a._arithmetic:
        json.dump(arithmetic_here(), sys.stdout)
        return

    now = _run(a.now, "--_rows")
    arithmetic = _run(a.now, "--_arithmetic")
    worktree = None
    before_dir = a.before
    if before_dir is None:
        worktree = Path(tempfile.mkdtemp(prefix="dskit-old-")) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(worktree), BEFORE_COMMIT],
            check=True,
        )
        before_dir = worktree
    try:
        before = _run(before_dir, "--_rows")
    finally:
        if worktree is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=True
            )
            worktree.parent.rmdir()
    key = lambda r: (r["model"], r["gpu"], r["gpus"])  # noqa: E731
    old = {key(r): r for r in before["rows"]}
    rows = [
        {"model": r["model"], "gpu": r["gpu"], "gpus": r["gpus"], "now": r, "before": old.get(key(r))}
        for r in now["rows"]
    ]
    for r in rows:
        for side in ("now", "before"):
            if r[side]:
                for k in ("model", "gpu", "gpus"):
                    r[side].pop(k, None)
    print(markdown(rows))
    print()
    print(arithmetic_markdown(arithmetic))
    if a.out:
        head = {
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": "none: dskit plan's memory and step-time models only",
            "now_code": str(a.now),
            "before_code": f"git worktree of {BEFORE_COMMIT}" if a.before is None else str(a.before),
            "per_node": PER_NODE,
            "fabric": FABRIC,
        }
        a.out.write_text(
            json.dumps(
                {**head, "rows": rows, "markdown": markdown(rows), "v3_arithmetic": arithmetic}, indent=1
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
