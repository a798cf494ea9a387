"""`dskit data prepare`: token shards from text, JSONL, Parquet, Arrow or chat records."""

from __future__ import annotations

import argparse
import os

from dskit.cli.args import Subparsers, count, fraction
from dskit.errors import SpecError
from dskit.host.extras import MODULES, missing, require

#: what `data prepare` imports of the train extra: no torch (a tokenizer directory adds transformers)
PREPARE_NEEDS = ("numpy", "tqdm")


def cmd_data(a: argparse.Namespace) -> int:
    from dskit.io.atomic import check_replaceable

    tokenizer_dir = None if a.tokenizer == "byte" else a.tokenizer
    require(
        "data prepare", "train", PREPARE_NEEDS if tokenizer_dir is None else (*PREPARE_NEEDS, "transformers")
    )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not 1 <= a.workers <= cpus:
        raise SpecError("--workers", f"{a.workers}: give 1 to {cpus} (this machine's CPUs)")
    check_replaceable(a.output, force=a.force, kind="data", inputs=[*a.inputs, tokenizer_dir])
    try:
        from dskit.data.prepare import prepare

        prepare(
            a.inputs,
            a.output,
            tokenizer=a.tokenizer,
            force=a.force,
            eval_fraction=a.eval_fraction,
            text_field=a.text_field,
            workers=a.workers,
        )
    except ModuleNotFoundError as e:
        # the data extra only where an input needs it (Parquet, Arrow, .zst), found as the inputs are read
        if e.name not in MODULES["data"]:
            raise
        raise missing("data prepare", "data", e.name) from None
    return 0


def add_data(sub: Subparsers) -> None:
    s = sub.add_parser("data", help="data tools: prepare token shards from text, JSONL, Parquet, Arrow, chat")
    dsub = s.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    d = dsub.add_parser(
        "prepare",
        help="tokenize text, JSONL, Parquet or Arrow (plain or chat records) into token shards",
        description="Tokenize the inputs into a shard directory for data.path (or one of data.sources). "
        "Records with 'messages' are chat: rendered with the tokenizer's chat template, loss only on the "
        "assistant turns. The output is written beside the destination and swapped in whole.",
    )
    d.add_argument(
        "inputs",
        nargs="+",
        help=".txt/.text/.md (one document each), .jsonl (those also .gz/.zst), .parquet, .arrow files or a "
        "local datasets save_to_disk dir; records with 'messages' are chat, others use the text field",
    )
    d.add_argument(
        "--text-field",
        default="text",
        help="the text field/column of JSONL, Parquet and Arrow records (default: text)",
    )
    d.add_argument("-o", "--output", required=True, help="shard directory to create")
    d.add_argument(
        "--tokenizer", default="byte", help="'byte' (built in) or a local Hugging Face tokenizer dir"
    )
    d.add_argument(
        "--eval-fraction",
        type=fraction,
        default=0.0,
        help="hold out about this share of the documents (0 to <1) in DIR/eval for the eval loss",
    )
    d.add_argument(
        "--workers",
        type=count,
        default=1,
        help="tokenizer processes, at most this machine's CPUs (default 1); the shards are byte-identical "
        "for any number",
    )
    d.add_argument(
        "--force", action="store_true", help="replace an existing directory of prepared data (only that)"
    )
    d.set_defaults(func=cmd_data)
