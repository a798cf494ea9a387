"""ZeRO++ and MiCS under AutoEP, as DeepSpeed 0.19.8 runs them: why no plan picks them.

docs/planner.md ("ZeRO stages", "Not searched") says why the search leaves out hpZ
(`zero_hpz_partition_size`), qgZ (`zero_quantized_gradients`) and MiCS (`mics_shard_size`): DeepSpeed
refuses each with AutoEP (or at all). These tests hand real DeepSpeed exactly what dskit would (a tiny
V2 plan: ZeRO-3, 2 gloo ranks, EP 2) with the one key added, and assert that refusal. When an upgrade
lifts one, its test fails: that is the moment to make the option a plan decision, counted in
memory and time and checked here like tests/train/test_zero_stages.py's stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dskit.plan.schema import dump_plan, load_plan
from tests.conftest import render_tiny
from tests.train.test_train import losses, run

#: (zero_optimization key, value, what DeepSpeed 0.19.8 says; where it says it)
REFUSED_WITH_AUTOEP = {
    # runtime/engine.py:2224-2227, DeepSpeedEngine._validate_zero3_moe_compatibility
    "hpz": (
        "zero_hpz_partition_size",
        2,
        "AutoEP with ZeRO Stage 3 does not support hpZeRO secondary tensor groups yet",
    ),
    # runtime/engine.py:2222-2223, the same check
    "qgz": (
        "zero_quantized_gradients",
        True,
        "AutoEP with ZeRO Stage 3 does not support zero_quantized_gradients yet",
    ),
}


def _plan_with(tmp: Path, key: str, value: object) -> Path:
    """The tiny ZeRO-3 plan, its DeepSpeed config given `key` (the plan never writes it: this is the
    probe), written back through the plan's own schema."""
    rd = render_tiny(tmp, "tiny-v2", steps=2, extra=["overrides.zero_stage=3"])
    plan = load_plan(rd / "run.yaml")
    ds = dict(plan.deepspeed)
    ds["zero_optimization"] = {**ds["zero_optimization"], key: value}
    (rd / "run.yaml").write_text(dump_plan(plan.model_copy(update={"deepspeed": ds})))
    assert load_plan(rd / "run.yaml").deepspeed["zero_optimization"][key] == value
    return rd


@pytest.mark.train
@pytest.mark.parametrize("name", sorted(REFUSED_WITH_AUTOEP))
def test_deepspeed_refuses_it_with_autoep_under_zero3(tmp_path, name):
    key, value, message = REFUSED_WITH_AUTOEP[name]
    rd = _plan_with(tmp_path, key, value)
    log = tmp_path / "train.log"
    code = run(rd, log)
    text = log.read_text()
    assert code != 0 and message in text, (code, text[-3000:])
    assert not losses(rd)


def test_mics_is_gone_from_deepspeed(tmp_path, monkeypatch):
    """MiCS was removed (runtime/config.py:119-125, refused in DeepSpeedConfig.__init__ at line 454):
    the config transformers' zero.Init and deepspeed.initialize both parse is refused before any
    model exists. The plan's own config, without the key, parses (so the refusal is the key's)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    rd = render_tiny(tmp_path, "tiny-v2", steps=2, extra=["overrides.zero_stage=3"])
    ds = load_plan(rd / "run.yaml").deepspeed
    # one process here: the plan's batch is for its 2 ranks
    one_rank = {
        **ds,
        "train_batch_size": ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"],
    }
    DeepSpeedConfig(one_rank)
    with pytest.raises(DeepSpeedConfigError, match="MiCS ZeRO-3 sharding has been removed"):
        DeepSpeedConfig({**one_rank, "zero_optimization": {**ds["zero_optimization"], "mics_shard_size": 2}})
