"""Chat fine-tuning against plain text on one GPU: real (non-pad) tokens/s, per attention backend.

The goal: packed chat SFT at >= 0.97x the real-token throughput of plain text at the same shape
(4-layer V2-Lite, global batch 16, the plan's pick; seq 4096 unless --seq-len). Two generated chat sets,
so the run is reproducible without a download (--data):
- `issue31` (default): 6,000 records, prompts of 20-200 words, answers of 50-600, from a 3,000-word
  vocabulary, tokenized by a byte-level BPE trained on it and prepared with `dskit data prepare`;
- `long-tail`: 9,000 chats of 1-3 turns, 214 tokens on average, long-tailed to 1,800
  (tests/support/chat_data.py `long_tail_chats`), byte tokens of the embedded corpus that plain text
  trains on.
Each variant is one `dskit train --local` run (bench/train_bench.py run_dskit); the figures are the
medians after the warm-up steps of its metrics.jsonl: `real_tokens_per_s_per_gpu` (what the goal
compares), `packing_efficiency`, and the plan-shape `tokens_per_s_per_gpu` (row capacity). The trainer
packs with `best_fit` (dskit/data/packing.py); the JSON also records, per seq, both packers' packing
efficiency on the same data. Prints a table and writes JSON:

    python bench/chat_bench.py --out bench/results/attention/h200-chat-2026-12-02.json
    python bench/chat_bench.py --data long-tail --seq-len 2048,4096 --backends flash_attention_4 \
        --out $OUT/h200-chat-long-tail-DATE.json --work /tmp/cw

`--packing` (CPU, no training): the packing efficiency of the packer before best fit (`next_fit`, kept
for this comparison only) and of the trainer's (`best_fit`) side by side on the same generated data,
one row per seq; a table and JSON:

    python bench/chat_bench.py --packing --data long-tail --seq-len 2048,4096,8192 \
        --out bench/results/attention/RESULT.json
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

from train_bench import BASE, GB16, WARMUP_STEPS, run_dskit  # noqa: E402

RECORDS, SEED = 6000, 0
DEFAULT_SEQ = next(int(s.split("=")[1]) for s in BASE if s.startswith("training.seq_len="))


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
    """The `issue31` chat set as a shard directory (and its tokenizer beside it)."""
    from tests.support.chat_data import make_tokenizer_from

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


def prepare_long_tail(work: Path) -> Path:
    """The long-tailed chat set as a shard directory (byte tokens: no tokenizer to train)."""
    from tests.support.chat_data import write_long_tail_shards

    return write_long_tail_shards(work / "long-tail-shards")


DATA = {"issue31": ("chat-shards", prepare), "long-tail": ("long-tail-shards", prepare_long_tail)}


def shards_of(data: str, work: Path) -> Path:
    name, make = DATA[data]
    return work / name if (work / name).is_dir() else make(work)


def packing_rows(shards: Path, seq_lens: list[int]) -> list[dict]:
    """Per seq, the packing efficiency the trainer would log over an epoch, with the packer before
    best fit and with the trainer's, on the same shards."""
    from dskit.data.packing import best_fit, next_fit
    from dskit.data.sampler import Sampler
    from dskit.data.shards import TokenData
    from tests.support.chat_data import epoch_packing_efficiency

    data = TokenData.open(str(shards))
    rows = []
    for seq in seq_lens:
        row: dict = {
            "seq_len": seq,
            "samples": sum(len(s.ends) for s in data.shards),
            "tokens": data.n_tokens,
        }
        for packer in (next_fit, best_fit):
            sampler = Sampler(data, seq, SEED, packer=packer)
            row[packer.__name__] = {
                "rows": sampler.windows,
                "packing_efficiency": round(epoch_packing_efficiency(sampler), 4),
            }
        rows.append(row)
    return rows


def print_packing(rows: list[dict]) -> None:
    print(
        "\n| seq | samples | next_fit rows | next_fit packing eff. | best_fit rows | best_fit packing eff. |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        old, new = r["next_fit"], r["best_fit"]
        print(
            f"| {r['seq_len']} | {r['samples']:,} | {old['rows']:,} | {old['packing_efficiency']:.4f} "
            f"| {new['rows']:,} | {new['packing_efficiency']:.4f} |"
        )


def variants(
    shards: Path, backends: list[str], seq_lens: list[int], checkpointing: bool = False
) -> dict[str, tuple[list[str], dict]]:
    """name -> (spec sets, what the row is: kind, backend, seq) for plain text and packed chat."""
    chat = [f"data.path={shards}", "data.packing=pack"]
    out = {}
    for seq in seq_lens:
        at = f", seq {seq}" if seq != DEFAULT_SEQ else ""
        for b in backends:
            # checkpointing: attention is recomputed in the backward, on the autograd engine's device thread
            pin = [f"training.seq_len={seq}", f"overrides.attention={b}"] + (
                ["overrides.activation_checkpointing=1"] if checkpointing else []
            )
            what = {"backend": b, "seq_len": seq}
            out[f"plain text, {b}{at}"] = ([*GB16, *pin], {**what, "kind": "plain"})
            out[f"chat packed, {b}{at}"] = ([*GB16, *pin, *chat], {**what, "kind": "chat"})
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
    ap.add_argument("--data", choices=sorted(DATA), default="issue31", help="the generated chat set")
    ap.add_argument(
        "--seq-len",
        default=str(DEFAULT_SEQ),
        help=f"comma-separated training.seq_len values (default {DEFAULT_SEQ})",
    )
    ap.add_argument("--only", help="run only variants whose name contains this text")
    ap.add_argument("--checkpointing", action="store_true", help="every layer checkpointed (recomputed)")
    ap.add_argument(
        "--packing",
        action="store_true",
        help="CPU only: both packers' packing efficiency on the chat set, per seq; no training",
    )
    args = ap.parse_args()
    try:
        seq_lens = [int(x) for x in args.seq_len.split(",")]
    except ValueError:
        ap.error(f"--seq-len: {args.seq_len!r} is not comma-separated integers, e.g. 2048,4096")
    work = args.work or Path(tempfile.mkdtemp(prefix="chat-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shards = shards_of(args.data, work)
    data = {"data": args.data, "chat_records": _documents(shards), "packing": packing_rows(shards, seq_lens)}
    if args.packing:
        import runs

        Path(args.out).write_text(json.dumps({**runs.header(), **data}, indent=1) + "\n")
        print_packing(data["packing"])
        return
    meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "host": platform.node(), **data}
    meta["warmup_steps"] = WARMUP_STEPS
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["torch"] = torch.__version__
    except Exception as e:  # the table still says where it ran
        meta["gpu"] = f"unknown ({e})"
    rows: list[dict] = []
    for name, (sets, what) in variants(
        shards, args.backends.split(","), seq_lens, args.checkpointing
    ).items():
        if args.only and args.only not in name:
            continue
        row = {**run_dskit(name, sets, {}, work / "runs", 1), **what}
        rows.append(row)
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        print(_line(row), flush=True)
    plain = {(r["backend"], r["seq_len"]): r for r in rows if r["kind"] == "plain" and "error" not in r}
    for r in rows:
        base = plain.get((r["backend"], r["seq_len"]))
        if r["kind"] == "chat" and "error" not in r and base:
            r["real_vs_plain"] = round(r["real_tok_s_gpu"] / base["real_tok_s_gpu"], 3)
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print_packing(meta["packing"])
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


def _documents(shards: Path) -> int:
    return int(json.loads((shards / "index.json").read_text())["documents"])


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['variant']}: ERROR {r['error'][-800:]}"
    return (
        f"{r['variant']}: real {r['real_tok_s_gpu']:,} tok/s/GPU (packing {r['packing_efficiency']:.3f}), "
        f"row {r['tok_s_gpu']:,}, step {r['step_s']} s, {r['peak_reserved_gb']} GiB, attention {r['attention']}"
    )


if __name__ == "__main__":
    main()
