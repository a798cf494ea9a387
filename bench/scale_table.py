"""The plan at cluster scale, on paper: no GPU, only `dskit plan`'s own models.

For DeepSeek-V2-Lite, V2 and V3 at 8, 64 and 256 GPUs (8 per node) of H100 and H200, with the default
spec (seq 4096, the default global batch), prints and writes:
- the pick of today's search (ZeRO 1-3, EP any divisor of the expert count and the world, inside a
  node or across nodes) with its step breakdown, predicted tokens/s/GPU and MFU;
- the pick of the search before it, rebuilt under today's constants: ZeRO-3 only, EP inside one node;
- the field's published figure for the same model and cluster, where one exists.

Terms measured here are on-node (one and two H200, bench/results/planner/h200*-planner-*.json); every term that
crosses the fabric (ZeRO collectives over the expert-data-parallel and dense groups, the all-to-all
when EP spans nodes) is extrapolated from the fabric catalog's bandwidth (`fabrics.yaml`, 50 GB/s per
GPU for InfiniBand NDR) with the on-node efficiencies.

    python bench/scale_table.py --out bench/results/scale/model-scale-table-2026-12-03.json
    python bench/scale_table.py --json     # rows, table and GPUs per node as JSON, for the tests
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

MODELS = ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3")
GPUS = ("h100-80gb", "h200-141gb")
WORLDS = (8, 64, 256)
PER_NODE = 8
#: published BF16 training throughput of the same model on the same cluster (tokens/s/GPU, seq 4096)
PUBLISHED = {
    ("deepseek-v3", "h100-80gb", 256): (
        1002,
        "NeMo AutoModel performance summary: PP 4, EP 64, FSDP 64, TransformerEngine + DeepEP",
    ),
    ("deepseek-v2-lite", "h100-80gb", 8): (11600, "torchtitan issue #1789: EP 8, 20.5% MFU"),
}


def _searched(model: str, gpu: str, world: int, sets: list[str]):
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    flags = {
        "model.preset": model,
        "hardware.gpu": gpu,
        "hardware.gpus_per_node": PER_NODE,
        "hardware.nodes": world // PER_NODE,
    }
    return build_plan_searched(load_spec(sets=sets, flags=flags))


def _cell(plan) -> dict:
    p, s = plan.parallel, plan.speed or {}
    return {
        "zero_stage": p.zero_stage,
        "ep_size": p.ep_size,
        "micro_batch": p.micro_batch,
        "grad_accum": p.grad_accum,
        "global_batch": p.global_batch,
        "activation_checkpointing": p.activation_checkpointing,
        "offload_optimizer": p.offload_optimizer,
        "memory_gib": plan.memory["total_gib"],
        "speed": s,
    }


def before(model: str, gpu: str, world: int) -> dict | None:
    """The earlier search under today's constants: ZeRO-3 and EP inside a node, chosen by the search's
    own rules (the tie window and the offload margin) over each in-node EP's winner."""
    from dskit import catalog
    from dskit.errors import SpecError
    from dskit.plan import search

    experts = catalog.model(model).config["n_routed_experts"]
    eps = sorted(d for d in search.ep_sizes(experts, world, PER_NODE) if d <= PER_NODE)  # the in-node ones
    found = []  # (the search's winning row, its plan) per EP
    for ep in eps:
        try:
            plan, f = _searched(model, gpu, world, ["overrides.zero_stage=3", f"overrides.ep_size={ep}"])
        except SpecError:
            continue
        found.append((f.chosen, plan))
    if not found:
        return None
    rows = [row for row, _ in found]
    best = search.pick(rows)
    return _cell(next(plan for row, plan in found if row is best))


def table() -> list[dict]:
    from dskit.errors import SpecError

    rows = []
    for model in MODELS:
        for gpu in GPUS:
            for world in WORLDS:
                row = {"model": model, "gpu": gpu, "gpus": world}
                try:
                    row["now"] = _cell(_searched(model, gpu, world, [])[0])
                except SpecError as e:
                    row["now"] = {"refused": f"{e.field}: {e.message}"}
                row["before"] = before(model, gpu, world)
                pub = PUBLISHED.get((model, gpu, world))
                row["published"] = {"tokens_per_s_per_gpu": pub[0], "source": pub[1]} if pub else None
                rows.append(row)
    return rows


def _pick(c: dict | None) -> str:
    if not c:
        return "does not fit"
    if "refused" in c:
        return "does not fit"
    ck = {0: "no ckpt", 1: "ckpt"}.get(c["activation_checkpointing"], f"ckpt/{c['activation_checkpointing']}")
    off = ", offload" if c["offload_optimizer"] else ""
    return f"ZeRO-{c['zero_stage']} EP {c['ep_size']} mb {c['micro_batch']}x{c['grad_accum']} {ck}{off}"


def _speed(c: dict | None) -> str:
    if not c or "refused" in c:
        return "-"
    s = c["speed"]
    return f"{s['tokens_per_s_per_gpu']:,} ({s['mfu']:.1%})"


def _where(c: dict | None) -> str:
    if not c or "refused" in c:
        return "-"
    s = c["speed"]
    parts = [
        ("compute", s.get("compute_s", 0)),
        ("layers", s.get("layer_gpu_s", 0)),
        ("ZeRO", s.get("collectives_s", 0) + s.get("boundary_s", 0)),
        ("grad copies", s.get("grad_copy_s", 0)),
        ("a2a", s.get("all_to_all_s", 0)),
        ("optim", s.get("optimizer_s", 0)),
    ]
    return ", ".join(f"{n} {v:.2f}" for n, v in parts if v) + f" of {s['step_s']:.2f} s"


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | GPUs | pick (today) | tok/s/GPU (MFU) | where the step goes (s) | before: ZeRO-3, EP in a node "
        "| before tok/s/GPU | published |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        pub = r["published"]
        published = f"{pub['tokens_per_s_per_gpu']:,}" if pub else "-"
        gpu = r["gpu"].split("-")[0].upper()
        lines.append(
            f"| {r['model']} | {r['gpus']} x {gpu} | {_pick(r['now'])} | {_speed(r['now'])} | {_where(r['now'])} "
            f"| {_pick(r['before'])} | {_speed(r['before'])} | {published} |"
        )
    return "\n".join(lines)


def as_json() -> dict:
    """The rows, the markdown table and GPUs per node: what `--json` prints and tests/plan/test_scale_table.py
    reads."""
    rows = table()
    return {"rows": rows, "markdown": markdown(rows), "per_node": PER_NODE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument(
        "--json",
        action="store_true",
        help="print the rows, the markdown table and GPUs per node as JSON (what tests/plan/test_scale_table.py reads)",
    )
    a = ap.parse_args()
    if a.json:
        json.dump(as_json(), sys.stdout)
        return
    rows = table()
    print(markdown(rows))
    if a.out:
        head = {
            **runs.model_header(),
        }
        a.out.write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
