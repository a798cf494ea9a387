"""Pipeline parallelism on paper: what DeepSpeed's PipelineEngine would give the plan.

The search has no pipeline axis: the trainer has no pipeline path yet, and a plan never picks what the
trainer cannot run. This script asks the planner's own memory and step-time models what one would buy,
so the work is sized before it is built. It is a what-if, not a term of the search.

A pipeline stage is modelled as a shallower model trained by world / pp ranks:
- its layers: ceil(L / pp), all MoE (the slowest, largest stage), plus one vocabulary matrix and the
  logits (the first stage holds the embedding, the last the LM head and its logits: both stages are
  taken as the largest, on the safe side);
- DeepSpeed's PipelineEngine allows ZeRO-0/1 only ("ZeRO-2 and ZeRO-3 are incompatible with pipeline
  parallelism", deepspeed/runtime/pipe/engine.py), so stage 1, no offload;
- its 1F1B schedule (no interleaving in DeepSpeed) holds min(pp, m) micro-batches' activations on the
  first stage and takes m + pp - 1 micro-step slots for m micro-batches per pipeline: the bubble
  (pp - 1) / (m + pp - 1) (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters", Sec. 2.2);
- every slot sends one micro-batch's hidden states (bf16, mb x seq x hidden) forward and its gradient
  back, blocking in DeepSpeed's schedule, over the fabric when a stage spans nodes;
- FLOPs per token: the whole model's / L per layer, times the stage's layers (embedding and head left
  out: balanced stages are what a partitioner aims for).

The memory and time terms are `dskit/plan/memory.py` and `dskit/plan/speed.py` unchanged, with the
plan's own settings for a ZeRO-1 candidate (regional compile, compiled attention, the fused step);
only the composition above is new. Fabric terms are extrapolated from `fabrics.yaml` as in bench/scale_table.py.

That DeepSpeed 0.19.8 can run it at all was checked on the CPU (gloo): PipelineModule over the HF
decoder layers, AutoEP (with `moe_layer_pattern` for the stage's module names) and ZeRO-1 gave the
plain model's losses to 1e-6 over 5 steps at PP 2 x EP 1 (2 ranks) and PP 2 x EP 2 (4 ranks)
(docs/planner.md "Pipeline parallelism, on paper").

    python bench/pipeline_what_if.py --gpu h100-80gb --out bench/results/pipeline/model-pipeline-what-if-v3-h100-2026-12-02.json
    python bench/pipeline_what_if.py --gpu h200-141gb --out bench/results/pipeline/model-pipeline-what-if-v3-h200-2026-12-02.json
    python bench/pipeline_what_if.py --set training.global_batch=4096 \
        --out bench/results/pipeline/model-pipeline-what-if-v3-h100-gb4096-2026-12-02.json
    python bench/pipeline_what_if.py --gpu h200-141gb --json "256 x H200"   # JSON and the docs row, for the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

#: activation checkpointing the what-if tries: off, every layer (every 2nd's recompute peak sits on top
#: of the stored layers of every in-flight micro-batch, which this composition does not model)
CKPTS = (0, 1)
PP_SIZES = (2, 4, 8, 16, 32)
#: layouts over the memory limit kept in the JSON: this many needing the least memory, and the fastest
NEAR_MISSES = 10


def _stage_cfg(cfg: dict, layers: int) -> dict:
    """The largest stage: `layers` MoE layers and one vocabulary matrix (the first stage's embedding or
    the last's head; `counts` takes tied embeddings as one)."""
    return {**cfg, "num_hidden_layers": layers, "first_k_dense_replace": 0, "tie_word_embeddings": True}


def what_if(model: str, gpu_name: str, nodes: int, per_node: int, sets: list[str]) -> dict:
    from dskit import catalog
    from dskit.plan import memory, search, speed
    from dskit.plan.build import build_plan_searched, resolve_fabric
    from dskit.plan.candidate import Candidate, Cluster, Workload
    from dskit.plan.fit import GPU_MEMORY_MARGIN
    from dskit.plan.links import Links
    from dskit.plan.model_math import counts, flops_per_token
    from dskit.plan.parallel import attention_compile
    from dskit.plan.shape import ModelShape
    from dskit.spec import load_spec

    flags = {
        "model.preset": model,
        "hardware.gpu": gpu_name,
        "hardware.gpus_per_node": per_node,
        "hardware.nodes": nodes,
    }
    spec = load_spec(sets=sets, flags=flags)
    plan, found = build_plan_searched(spec)
    gpu = catalog.gpu(gpu_name)
    fabric = resolve_fabric(spec, gpu)
    cfg, seq = plan.model.config, plan.parallel.seq_len
    world, L = plan.hardware.world_size, cfg["num_hidden_layers"]
    full = counts(ModelShape.from_config(cfg), seq)
    fpt_layer = flops_per_token(full) / L
    limit = gpu.usable_memory_gib * (1 - GPU_MEMORY_MARGIN)
    # what the planner would time a ZeRO-1 candidate with (dskit/plan/parallel.py): the fused step and
    # each attention block compiled, unless the spec turns them off
    fused = spec.overrides.optimizer_step != "deepspeed"
    attention = attention_compile(spec.overrides.compile, gpu)
    tokens_per_gpu = plan.parallel.global_batch * seq / world
    rows = []
    for pp in PP_SIZES:
        if world % pp or pp > L:
            continue
        dp, layers = world // pp, math.ceil(L / pp)
        per_pipeline = plan.parallel.global_batch // dp
        if per_pipeline * dp != plan.parallel.global_batch:
            continue
        stage = ModelShape.from_config(_stage_cfg(cfg, layers))
        sc = counts(stage, seq)
        for ep in search.ep_sizes(cfg["n_routed_experts"], dp, per_node):
            for mb in search.micro_batches(per_pipeline, on_cpu=False):
                m = per_pipeline // mb
                inflight = min(pp, m)
                held_stage = ModelShape.from_config(_stage_cfg(cfg, layers * inflight))
                for ck in CKPTS:
                    c = Candidate(ep_size=ep, micro_batch=mb, ckpt_every=ck, offload=False, zero_stage=1)
                    cluster = Cluster(gpu, world=dp, per_node=per_node, peak_tflops=plan.hardware.peak_tflops)

                    timed = Workload(
                        stage,
                        sc,
                        fpt_layer * layers,
                        seq_len=seq,
                        per_rank=mb * m,
                        compiled=plan.parallel.compile_regions,
                        compiled_attention=attention,
                        fused_step=fused,
                        loss=spec.overrides.loss,
                    )
                    # memory: one micro-step per step (per_rank mb): the pipeline engine reduces once,
                    # after the last backward (pipe/schedule.py ReduceGrads), when the activations are
                    # freed, so ZeRO-1's second gradient copy (memory.boundary_grad_copy) never meets them
                    kept = dataclasses.replace(timed, per_rank=mb, compiled_attention=False, fused_step=False)
                    one = memory.estimate(kept, c, cluster)
                    held = memory.estimate(dataclasses.replace(kept, shape=held_stage), c, cluster)
                    total = one.total_gib - one.activations_gib + held.activations_gib
                    build = memory.construction(sc, world=dp, ep_size=ep, on_gpu=True, zero_stage=1)
                    t = speed.predict(timed, c, cluster, Links(gpu.interconnect_gbs, fabric.gbs_per_gpu))
                    # the pipeline engine's step after the last micro-step: nothing overlaps it
                    slot = max(t.micro_gpu_s, t.host_s) / m
                    spans = dp >= per_node  # a stage of a node or more: its neighbour is on another node
                    bw = fabric.gbs_per_gpu if spans else gpu.interconnect_gbs
                    p2p = 2 * mb * seq * cfg["hidden_size"] * speed.WIRE_BYTES / (bw * speed.GB)
                    step = (m + pp - 1) * (slot + p2p) + t.optimizer_s + t.boundary_s
                    # the same with no fixed cost per layer pass (GPU_LAYER_PASS_S, SYNC_LAYER_PASS_S) and
                    # no host timeline: a bound, to show what the pipeline's many small micro-steps cost
                    floor = (
                        (m + pp - 1) * ((t.compute_s + t.all_to_all_s) / m + p2p)
                        + t.optimizer_s
                        + t.boundary_s
                    )
                    rows.append(
                        {
                            "pp": pp,
                            "ep": ep,
                            "micro_batch": mb,
                            "micro_batches": m,
                            "ckpt_every": ck,
                            "memory_gib": round(total, 1),
                            "construction_gib": round(build.total_gib, 1),
                            "fits": max(total, build.total_gib) <= limit,
                            "bubble": round((pp - 1) / (m + pp - 1), 3),
                            "compute_s": round(t.compute_s * (m + pp - 1) / m, 2),
                            "all_to_all_s": round(t.all_to_all_s * (m + pp - 1) / m, 2),
                            "p2p_s": round((m + pp - 1) * p2p, 2),
                            "zero1_s": round(t.boundary_s, 2),
                            "optimizer_s": round(t.optimizer_s, 3),
                            "step_s": round(step, 2),
                            "tokens_per_s_per_gpu": round(tokens_per_gpu / step),
                            "bound": t.bound,
                            "no_per_pass_cost_tokens_per_s_per_gpu": round(tokens_per_gpu / floor),
                        }
                    )
    pick = plan.parallel
    return {
        "model": model,
        "gpu": gpu_name,
        "gpus": world,
        "global_batch": pick.global_batch,
        "limit_gib": round(limit, 1),
        "today": {
            "pick": found.chosen.candidate.describe(),
            "short": _short(found.chosen.candidate),
            "tokens_per_s_per_gpu": plan.speed["tokens_per_s_per_gpu"] if plan.speed else None,
        },
        # every layout that fits, fastest first, then those over the limit: the NEAR_MISSES that need the
        # least memory and the NEAR_MISSES fastest (what memory costs)
        "rows": _kept(rows),
    }


def _kept(rows: list[dict]) -> list[dict]:
    fits = sorted((r for r in rows if r["fits"]), key=lambda r: -r["tokens_per_s_per_gpu"])
    over = [r for r in rows if not r["fits"]]
    least = sorted(over, key=lambda r: max(r["memory_gib"], r["construction_gib"]))[:NEAR_MISSES]
    fastest = sorted(over, key=lambda r: -r["tokens_per_s_per_gpu"])[:NEAR_MISSES]
    return fits + least + [r for r in fastest if r not in least]


def markdown(result: dict, top: int) -> str:
    lines = [
        f"{result['model']} on {result['gpus']} x {result['gpu']}, global batch {result['global_batch']}: "
        f"today's pick {result['today']['pick']}, {result['today']['tokens_per_s_per_gpu']:,} tokens/s/GPU; "
        f"GPU limit {result['limit_gib']} GiB",
        "",
        "| PP | EP | mb x m | ckpt | GiB (build) | bubble | compute | a2a | p2p | ZeRO-1 | step s | tok/s/GPU "
        "| without per-pass costs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown = [r for r in result["rows"] if r["fits"]][:top]
    for r in shown:
        lines.append(
            f"| {r['pp']} | {r['ep']} | {r['micro_batch']} x {r['micro_batches']} | "
            f"{'every layer' if r['ckpt_every'] else 'off'} | {r['memory_gib']} ({r['construction_gib']}) | "
            f"{r['bubble']:.0%} | {r['compute_s']} | {r['all_to_all_s']} | {r['p2p_s']} | {r['zero1_s']} | "
            f"{r['step_s']} | {r['tokens_per_s_per_gpu']:,} | {r['no_per_pass_cost_tokens_per_s_per_gpu']:,} |"
        )
    if not shown:
        lines.append("| no pipeline layout fits | | | | | | | | | | | | |")
    return "\n".join(lines)


def summary(result: dict, label: str) -> str:
    """The row of docs/planner.md's "Pipeline parallelism, on paper" table for this result."""
    today = result["today"]
    pick = today["short"]
    fits = [r for r in result["rows"] if r["fits"]]
    if not fits:
        return f"| {label} | {pick}: {today['tokens_per_s_per_gpu']:,} | none fits | - | - |"
    b = fits[0]
    layout = f"PP {b['pp']} x EP {b['ep']}, mb {b['micro_batch']} x {b['micro_batches']}"
    layout += ", ckpt" if b["ckpt_every"] else ""
    return (
        f"| {label} | {pick}: {today['tokens_per_s_per_gpu']:,} | {layout} "
        f"| {b['tokens_per_s_per_gpu']:,} | {b['no_per_pass_cost_tokens_per_s_per_gpu']:,} |"
    )


def _short(c) -> str:
    """A candidate (`candidate.Candidate`) as the docs' table names it: 'ZeRO-3 EP 8 mb 4, ckpt, offload'."""
    short = f"ZeRO-{c.zero_stage} EP {c.ep_size} mb {c.micro_batch}"
    short += "" if not c.ckpt_every else ", ckpt" if c.ckpt_every == 1 else f", ckpt/{c.ckpt_every}"
    return short + (", offload" if c.offload else "")


def as_json(model: str, gpu: str, nodes: int, gpus_per_node: int, sets: list[str], label: str) -> dict:
    """The result with `summary`, its docs table row under `label`: what `--json LABEL` prints and
    tests/plan/test_pipeline_what_if.py reads."""
    result = what_if(model, gpu, nodes, gpus_per_node, sets)
    return {**result, "summary": summary(result, label)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a spec override")
    ap.add_argument("--top", type=int, default=8, help="fitting layouts to print, fastest first")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument(
        "--json",
        metavar="LABEL",
        help="print only the result as JSON, with `summary`: its docs table row under this label "
        "(what tests/plan/test_pipeline_what_if.py reads)",
    )
    a = ap.parse_args()
    from dskit.errors import SpecError

    try:
        if a.json:
            json.dump(as_json(a.model, a.gpu, a.nodes, a.gpus_per_node, a.set, a.json), sys.stdout)
            return
        result = what_if(a.model, a.gpu, a.nodes, a.gpus_per_node, a.set)
    except SpecError as e:
        print(f"pipeline_what_if: {e.field}: {e.message}", file=sys.stderr)
        sys.exit(2)
    print(markdown(result, a.top))
    print("\ndocs/planner.md row:\n" + summary(result, f"{result['gpus']} x {a.gpu.split('-')[0].upper()}"))
    if a.out:
        head = {
            **runs.model_header(),
        }
        a.out.write_text(json.dumps({**head, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
