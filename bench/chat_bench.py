"""Chat fine-tuning against plain text on one GPU: real (non-pad) tokens/s, per attention backend.

Issue 31's goal: packed chat SFT at >= 0.97x the real-token throughput of plain text at the same shape
(4-layer V2-Lite, seq 4096, global batch 16, the plan's pick). The chat set is generated here as the
issue describes it (6,000 records, prompts of 20-200 words, answers of 50-600, from a 3,000-word
vocabulary), tokenized by a byte-level BPE trained on it and prepared with `dskit data prepare`, so
the run is reproducible without a download. Each variant is one `dskit train --local` run
(bench/train_bench.py run_dskit); the figures are the medians after the warm-up steps of its
metrics.jsonl: `real_tokens_per_s_per_gpu` (what the goal compares), `packing_efficiency`, and the
plan-shape `tokens_per_s_per_gpu` (row capacity). Prints a table and writes JSON:

    python bench/chat_bench.py --out bench/results/attention/h200-chat-2026-12-02.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from train_bench import GB16, WARMUP_STEPS, run_dskit  # noqa: E402

RECORDS, SEED = 6000, 0


def chat_records(n: int = RECORDS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(3000)]

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))

    return [
        {
            "messages": [
                {"role": "user", "content": words(20, 200)},
                {"role": "assistant", "content": words(50, 600)},
            ]
        }
        for _ in range(n)
    ]


def prepare(work: Path) -> Path:
    """The chat set as a shard directory (and its tokenizer beside it)."""
    from chat_data import make_tokenizer_from  # tests/support/chat_data.py

    records = chat_records()
    src = work / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = make_tokenizer_from(
        work / "tokenizer", [m["content"] for r in records for m in r["messages"]], 32000
    )
    shards = work / "chat-shards"
    cmd = [
        sys.executable,
        "-m",
        "dskit",
        "data",
        "prepare",
        str(src),
        "-o",
        str(shards),
        "--tokenizer",
        str(tok),
    ]
    subprocess.run(cmd, check=True, cwd=REPO)
    return shards


def variants(shards: Path, backends: list[str], checkpointing: bool = False) -> dict[str, list[str]]:
    chat = [f"data.path={shards}", "data.packing=pack"]
    out = {}
    for b in backends:
        # checkpointing: attention is recomputed in the backward, on the autograd engine's device thread
        pin = [f"overrides.attention={b}"] + (
            ["overrides.activation_checkpointing=1"] if checkpointing else []
        )
        out[f"plain text, {b}"] = [*GB16, *pin]
        out[f"chat packed, {b}"] = [*GB16, *pin, *chat]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after every variant)")
    ap.add_argument("--work", type=Path, help="keep data, run dirs and logs here (default: a temporary dir)")
    ap.add_argument(
        "--backends",
        default="flash_attention_4,sdpa_cudnn",
        help="comma-separated overrides.attention values",
    )
    ap.add_argument("--only", help="run only variants whose name contains this text")
    ap.add_argument("--checkpointing", action="store_true", help="every layer checkpointed (recomputed)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="chat-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shards = work / "chat-shards"
    if not shards.is_dir():
        shards = prepare(work)
    rows: list[dict] = []
    meta = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "chat_records": RECORDS,
        "warmup_steps": WARMUP_STEPS,
    }
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["torch"] = torch.__version__
    except Exception as e:  # the table still says where it ran
        meta["gpu"] = f"unknown ({e})"
    for name, sets in variants(shards, args.backends.split(","), args.checkpointing).items():
        if args.only and args.only not in name:
            continue
        row = run_dskit(name, sets, {}, work / "runs", 1)
        rows.append(row)
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        print(_line(row), flush=True)
    plain = {
        r["variant"].split(", ")[1]: r for r in rows if r["variant"].startswith("plain") and "error" not in r
    }
    for r in rows:
        b = r["variant"].split(", ")[1]
        if r["variant"].startswith("chat") and "error" not in r and b in plain:
            r["real_vs_plain"] = round(r["real_tok_s_gpu"] / plain[b]["real_tok_s_gpu"], 3)
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(
        "\n| variant | real tok/s/GPU | packing eff. | row tok/s/GPU | step s | peak reserved GiB | x plain |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | ERROR | | | | | |")
            continue
        print(
            f"| {r['variant']} | {r['real_tok_s_gpu']:,} | {r['packing_efficiency']:.3f} | {r['tok_s_gpu']:,} "
            f"| {r['step_s']} | {r['peak_reserved_gb']} | {r.get('real_vs_plain', '')} |"
        )


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['variant']}: ERROR {r['error'][-800:]}"
    return (
        f"{r['variant']}: real {r['real_tok_s_gpu']:,} tok/s/GPU (packing {r['packing_efficiency']:.3f}), "
        f"row {r['tok_s_gpu']:,}, step {r['step_s']} s, {r['peak_reserved_gb']} GiB, attention {r['attention']}"
    )


if __name__ == "__main__":
    main()
