"""Fine-tuning on chat data end to end: a tiny DeepSeek-V2 saved with
`save_pretrained`, a chat set prepared with a local tokenizer's chat template and a held-out split,
trained on 2 CPU ranks (EP 2, ZeRO-3) with the masked loss and whole-sample packing.

- The trainer's first-step loss equals the masked loss Hugging Face computes on the same packed
  batches with per-sample position ids (so the trainer takes the mask and confines attention as
  tests/data/test_data.py checks it does for the model itself);
- the eval loss is logged every N steps and at the end, and falls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dskit import catalog
from dskit.plan.schema import load_plan
from tests.conftest import dskit, render_tiny
from tests.support.chat_data import conversations, make_tokenizer, write_jsonl
from tests.support.hf_reference import first_step_loss
from tests.train.test_train import losses, records, run

pytestmark = pytest.mark.train
STEPS, EVAL_EVERY = 24, 8


def hf_first_step_loss(model_dir: Path, run_dir: Path, *, masked: bool = True) -> float:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    return first_step_loss(m, run_dir, masked=masked)


def hf_eval_loss(model_dir: Path, run_dir: Path) -> float:
    """The saved model's per-token loss over the held-out samples the trainer's eval reads (the
    eval before any training step, for comparison)."""
    from transformers import AutoModelForCausalLM

    from dskit.data import IGNORE_INDEX
    from dskit.data.sampler import Sampler
    from dskit.data.shards import TokenData

    plan = load_plan(run_dir / "run.yaml")
    par, world = plan.parallel, plan.hardware.world_size
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    m.config.use_cache = False
    held = Sampler(TokenData.open(f"{plan.run.data_path}/eval"), par.seq_len, plan.run.seed)
    batches = min(plan.run.eval_batches, held.windows // (world * par.micro_batch))
    b = held.get(0, batches * world * par.micro_batch)  # every rank's eval samples, in one batch
    with torch.no_grad():
        logits = m(
            input_ids=torch.from_numpy(b.input_ids), position_ids=torch.from_numpy(b.position_ids)
        ).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        torch.from_numpy(b.labels).reshape(-1),
        ignore_index=IGNORE_INDEX,
    ).item()


def test_chat_fine_tune_from_a_saved_model_with_masked_loss_and_a_falling_eval_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    from dskit.data.sampler import Sampler
    from dskit.data.shards import TokenData
    from dskit.train.model import hf_config

    tok = make_tokenizer(tmp_path / "tokenizer")
    write_jsonl(tmp_path / "chat.jsonl", conversations(400))
    dskit(
        "data", "prepare", str(tmp_path / "chat.jsonl"), "-o", str(tmp_path / "shards"),
        "--tokenizer", str(tok), "--eval-fraction", "0.1", check=True,
    )  # fmt: skip
    # The published checkpoint: a tiny V2 that has seen the chat format (a few unmasked steps, so its
    # loss on prompt tokens differs from its loss on replies and step 1 tells whether the mask was used).
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(hf_config(catalog.model("tiny-v2").config, "sdpa"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    pre = Sampler(TokenData.open(str(tmp_path / "shards")), 128, seed=99)
    for step in range(20):
        b = pre.get(8 * step, 8)
        ids = torch.from_numpy(b.input_ids)
        m(
            input_ids=ids, labels=ids, position_ids=torch.from_numpy(b.position_ids), use_cache=False
        ).loss.backward()
        opt.step()
        opt.zero_grad()
    hf = tmp_path / "tiny-v2-hf"
    m.to(torch.bfloat16).save_pretrained(hf)
    rd = render_tiny(
        tmp_path,
        None,
        steps=STEPS,
        extra=[
            f"model.path={hf}",
            f"data.path={tmp_path / 'shards'}",
            f"training.eval_every={EVAL_EVERY}",
            "training.eval_batches=4",
            "training.lr=1e-2",
            "checkpoint.every=1000",
        ],
    )
    log = tmp_path / "train.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]

    # step 1 is the saved model's masked loss on the packed batches: the trainer took the mask
    # (the same model's loss on every token is far from it)
    masked = hf_first_step_loss(hf, rd)
    assert losses(rd)[1] == pytest.approx(masked, rel=1e-2)
    assert abs(hf_first_step_loss(hf, rd, masked=False) - masked) > 0.1 * masked

    out = Path(load_plan(rd / "run.yaml").run.output_dir)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    before = hf_eval_loss(hf, rd)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < before, (before, evals)
    assert evals[-1]["eval_loss"] < 0.9 * before, (before, evals)
    assert all(e["eval_tokens"] > 0 for e in evals)
    text = log.read_text()
    assert f"eval step {STEPS} loss" in text
    assert "eval: " in text and "/eval, every 8 steps" in text
    pad_rows_report_their_true_rate(tmp_path, hf)


def pad_rows_report_their_true_rate(tmp_path: Path, hf: Path) -> None:
    """`packing: pad` (one sample a row): rows are cut to a bucket of the micro-batch's longest sample,
    the first loss is still Hugging Face's on those batches, and the metrics count real tokens: the
    packing efficiency is exactly the batches' real tokens over the rows' capacity, and the padding
    warning comes once exactly when over a third of what was computed is padding."""
    from dskit.data.sampler import Sampler, sample_index
    from dskit.data.shards import TokenData

    extra = [
        f"model.path={hf}",
        f"data.path={tmp_path / 'shards'}",
        "data.packing=pad",
        "checkpoint.final=false",
    ]
    rd = render_tiny(tmp_path / "pad", None, steps=2, extra=extra)
    log = tmp_path / "pad.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]
    assert losses(rd)[1] == pytest.approx(hf_first_step_loss(hf, rd), rel=1e-2)
    plan = load_plan(rd / "run.yaml")
    par, world = plan.parallel, plan.hardware.world_size
    sampler = Sampler(TokenData.open(plan.run.data_path), par.seq_len, plan.run.seed, packing="pad")

    def step_tokens(step: int) -> tuple[int, int]:  # (real, computed) over every rank's micro-batches
        firsts = [
            sample_index(step, m, r, grad_accum=par.grad_accum, world=world, micro_batch=par.micro_batch)
            for r in range(world)
            for m in range(par.grad_accum)
        ]
        batches = [sampler.get(f, par.micro_batch) for f in firsts]
        return sum(b.real_tokens for b in batches), sum(b.input_ids.size for b in batches)

    capacity = world * par.grad_accum * par.micro_batch * par.seq_len
    steps = [step_tokens(0), step_tokens(1)]
    for (real, computed), rec in zip(steps, records(rd), strict=True):
        assert real < computed <= capacity
        assert rec["packing_efficiency"] == round(real / capacity, 4) < 1
        assert rec["real_tokens_per_s_per_gpu"] < rec["tokens_per_s_per_gpu"]
    padded = any((c - r) / c > 1 / 3 for r, c in steps)
    assert log.read_text().count("were padding (rows") == (1 if padded else 0), steps
