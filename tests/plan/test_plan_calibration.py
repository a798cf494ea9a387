"""The planner against the H200 measurements committed in bench/results, against three goals.

Every run there was trained through the real trainer with one candidate forced; here today's plan is
rebuilt for each and compared, so a change to the memory or step-time model that breaks calibration
fails in CI (no GPU needed, nothing outside the repository read):
- the plan's memory total within +-10% of the peak the allocator reserved;
- predicted tokens/s/GPU within +-15% of the measured median;
- for every configuration as the plan runs it on GPUs (regional compile, the GPU default),
  the planner's own pick is a measured candidate within 5% of the fastest that it may take (a run
  measured above the plan's memory limit, 90% of the GPU, is not one). The eager runs predate ZeRO-1/2
  as a plan choice: their picks are now ZeRO-2 and were measured for the reference shape only, so they
  stay in the prediction test. The 2-GPU configurations were all eager: re-measuring their picks needs
  the 2-GPU kind (issue "Multi-GPU validation").
- LoRA runs (`h200-lora-*.json`, `bench/plan_bench.py --set LORA` / `LORA-CAL`) are held to the same
  bounds; their picks are checked where more than one candidate of a configuration was measured.
- DeepSeek-V3's width (`h200-v3-width-*.json`, `--set V3`): the same bounds, memory and speed apart,
  one pick miss marked as a strict expected failure (docs/planner.md "ZeRO stages").
- ZeRO-1 picks of the one-GPU configurations (`h200-zero1-*.json`): the prediction bounds; ZeRO-1's and
  ZeRO-2's picks side by side, each pair in one call, ZeRO-3's beside them where the plan takes it
  (`h200-zero12-*.json`): the bounds and the pick.

The files are picked by their series in bench/results/MANIFEST.yaml; their rows and today's prediction
of each come from the bench script that wrote them, imported (tests/support/calibration.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import peer_bench, runs
from tests.support import calibration

PLAN_BENCH = "plan_bench.py"
ROWS = calibration.rows(PLAN_BENCH, "planner")
LORA_ROWS = calibration.rows(PLAN_BENCH, "lora")


def _plan(r: dict) -> dict:
    p = calibration.predicted(PLAN_BENCH, r)
    if "_error" in p:  # not an AssertionError: no expected failure may swallow it
        raise RuntimeError(p["_error"])
    return p


def config_key(r: dict) -> str:
    return r["_config_key"]


def forced_overrides(r: dict) -> list[str]:
    return r["_forced_overrides"]


def repredict(r: dict) -> tuple[dict, str]:
    """Today's plan for a measured row: its prediction and verdict (bench/plan_bench.py `repredict`)."""
    p = _plan(r)
    return p["_predicted"], p["_verdict"]


def planner_pick(r: dict) -> list[str]:
    """Today's pick for the row's configuration, as forced overrides (bench/plan_bench.py `planner_pick`)."""
    return _plan(r)["_pick"]


def fastest_fitting(rows: list[dict]) -> float:
    """The best measured tokens/s/GPU among a configuration's runs that today's plan would take: a run
    that went through above the plan's memory limit (90% of the GPU) is not a candidate it may pick."""
    return max(r["measured"]["tokens_per_s_per_gpu"] for r in rows if repredict(r)[0]["fits"])


def _id(r: dict) -> str:
    return f"{r['config']}:{'-'.join(o.split('=')[1] for o in r['overrides'])}"


def test_the_measurements_cover_the_issue():
    """At least 8 configurations on 1 and 2 GPUs, each with rejected candidates beside the pick (eager);
    compiled runs (the GPU default) of at least 8 configurations, two with rejected
    candidates where compiling changed the pick."""
    eager = {r["config"] for r in ROWS if config_key(r) == r["config"]}
    assert len(eager) >= 8 and {r["gpus"] for r in ROWS} == {1, 2}
    assert all(sum(r["config"] == c for r in ROWS) >= 3 for c in eager)
    compiled = [config_key(r) for r in ROWS if config_key(r) != r["config"]]
    assert len(set(compiled)) >= 8
    assert sum(compiled.count(c) >= 3 for c in set(compiled)) >= 2


def test_the_lora_measurements_cover_full_depth_and_checkpointing():
    """Full-depth V2-Lite on one H200, uncheckpointed and checkpointed, beside shallower ones."""
    lora = [r for r in LORA_ROWS if "finetune.method=lora" in r["sets"]]
    assert len(lora) >= 6 and {r["config"].split()[0] for r in lora} >= {"L4", "L12", "L27"}
    ckpt = {forced_overrides(r)[3] for r in lora}
    assert {"overrides.activation_checkpointing=0", "overrides.activation_checkpointing=1"} <= ckpt


@pytest.mark.parametrize("row", ROWS + LORA_ROWS, ids=_id)
def test_prediction_matches_measurement(row):
    predicted, summary = repredict(row)
    m = row["measured"]
    assert predicted["memory_gib"] == pytest.approx(m["peak_reserved_gib"], rel=0.10), summary
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(m["tokens_per_s_per_gpu"], rel=0.15), summary


_LORA_COMPARED = {k for k, n in Counter(map(config_key, LORA_ROWS)).items() if n > 1}


@pytest.mark.parametrize(
    "config",
    sorted({config_key(r) for r in ROWS if config_key(r) != r["config"]} | _LORA_COMPARED),
)
def test_the_pick_is_the_fastest_measured(config):
    rows = [r for r in ROWS + LORA_ROWS if config_key(r) == config]
    pick = planner_pick(rows[0])
    fastest = fastest_fitting(rows)
    picked = [r for r in rows if forced_overrides(r) == pick]
    assert picked, f"{config}: today's pick {pick} was never measured; rerun bench/plan_bench.py"
    assert picked[0]["measured"]["tokens_per_s_per_gpu"] >= 0.95 * fastest, json.dumps(picked[0]["measured"])


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V3's width (bench/plan_bench.py --set V3): the same goals, with today's known miss
# kept strict, so that the fix it calls for turns it into a failure to move back among the others

V3_ROWS = calibration.rows(PLAN_BENCH, "v3-width")
#: the configurations whose pick today's model misses at V3's width on one GPU (docs/planner.md "ZeRO
#: stages"): with ZeRO-1/2's boundary gradient copy counted, their no-recompute runs (measured at 127.6
#: and 134.5 GiB reserved) are over the 90% limit, and the pick falls to ZeRO-3, predicted within the 3%
#: tie of ZeRO-2 with every 2nd layer checkpointed and preferred for recomputing nothing; ZeRO-3's step
#: at V3's width is predicted 10% fast, and it measured 11% slower
V3_PICK_MISSES = {
    "V3s L3 s4096 gb2 compiled": "ZeRO-3's step at V3's width predicted 10% fast: the tie's pick 11% slower"
}


def _v3_pick_case(config: str):
    why = V3_PICK_MISSES.get(config)
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=why)] if why else []
    return pytest.param(config, id=config, marks=marks)


def test_the_v3_width_runs_cover_every_zero_stage():
    assert {forced_overrides(r)[0] for r in V3_ROWS} == {f"overrides.zero_stage={z}" for z in (1, 2, 3)}


#: ZeRO-1, the planner's pick of each one-GPU configuration when the search is narrowed to it
#: (`plan_bench.py --zero-stage 1 --picks-only`), with today's defaults (compile on, the fused step).
#: The other candidates of those configurations were measured in earlier calls with the earlier defaults
#: (compiled regions, DeepSpeed's step), so these rows are held to the prediction bounds only: the pick
#: test would compare the defaults and the calls, not the planner's choice.
ZERO1_ROWS = calibration.rows(PLAN_BENCH, "zero1")


def test_the_zero1_runs_cover_ten_one_gpu_configurations():
    configs = {r["config"] for r in ZERO1_ROWS}
    assert len(configs) >= 10 and configs <= {r["config"] for r in ROWS if r["gpus"] == 1}
    assert all("overrides.zero_stage=1" in r["overrides"] and r["gpus"] == 1 for r in ZERO1_ROWS)


@pytest.mark.parametrize("row", ZERO1_ROWS, ids=_id)
def test_zero1_prediction_matches_measurement(row):
    test_prediction_matches_measurement(row)


#: ZeRO-2's and ZeRO-1's picks of each one-GPU configuration side by side, each pair in one call
#: (`plan_bench.py --zero-stage 2 --zero-stage 1 --picks-only`, today's defaults): the stage choice
#: judged on one machine, which the runs above cannot do
ZERO12_ROWS = calibration.rows(PLAN_BENCH, "zero12")


def test_zero1_and_zero2_ran_side_by_side_on_ten_configurations():
    stages = {(r["config"], forced_overrides(r)[0]) for r in ZERO12_ROWS}
    configs = {c for c, _ in stages}
    assert len(configs) >= 10 and all(r["gpus"] == 1 for r in ZERO12_ROWS)
    assert all((c, f"overrides.zero_stage={z}") in stages for c in configs for z in (1, 2))


@pytest.mark.parametrize("row", ZERO12_ROWS, ids=_id)
def test_zero12_prediction_matches_measurement(row):
    test_prediction_matches_measurement(row)


@pytest.mark.parametrize("config", sorted({r["config"] for r in ZERO12_ROWS}))
def test_the_pick_is_the_fastest_of_the_stages_side_by_side(config):
    """The plan's pick was measured beside each stage's own pick and is within 5% of the fastest that
    fits (ZeRO-3 is measured beside them where the plan takes it: h200-zero12-boundary-*.json)."""
    rows = [r for r in ZERO12_ROWS if r["config"] == config]
    pick = planner_pick(rows[0])
    picked = [r for r in rows if forced_overrides(r) == pick]
    assert picked, f"{config}: today's pick {pick} was never measured"
    assert picked[0]["measured"]["tokens_per_s_per_gpu"] >= 0.95 * fastest_fitting(rows)


@pytest.mark.parametrize("row", V3_ROWS, ids=_id)
def test_v3_width_memory_matches_measurement(row):
    predicted, summary = repredict(row)
    assert predicted["memory_gib"] == pytest.approx(row["measured"]["peak_reserved_gib"], rel=0.10), summary


@pytest.mark.parametrize("row", V3_ROWS, ids=_id)
def test_v3_width_speed_matches_measurement(row):
    predicted, summary = repredict(row)
    want = row["measured"]["tokens_per_s_per_gpu"]
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(want, rel=0.15), summary


@pytest.mark.parametrize("config", [_v3_pick_case(c) for c in sorted({config_key(r) for r in V3_ROWS})])
def test_v3_width_pick_is_the_fastest_measured(config):
    rows = [r for r in V3_ROWS if config_key(r) == config]
    pick = planner_pick(rows[0])
    picked = [r for r in rows if forced_overrides(r) == pick]
    assert picked, f"{config}: today's pick {pick} was never measured"
    assert picked[0]["measured"]["tokens_per_s_per_gpu"] >= 0.95 * fastest_fitting(rows)


# ---------------------------------------------------------------------------------------------------
# LoRA on an FP8 base beside a bf16 base (bench/fp8_lora_bench.py): the same bounds


FP8_BENCH = "fp8_lora_bench.py"
FP8_ALL = calibration.rows(FP8_BENCH, "fp8-lora")


def fp8_repredict(r: dict) -> dict:
    """Today's plan for an FP8-bench row, its candidate pinned (bench/fp8_lora_bench.py `repredict`)."""
    p = calibration.predicted(FP8_BENCH, r)
    if "_error" in p:  # not an AssertionError: no expected failure may swallow it
        raise RuntimeError(p["_error"])
    return p["_predicted"]


#: runs from a bf16 model.path with checkpointing, measured before the trainer set train mode on models
#: from_pretrained returns in eval mode (dskit/train/model.py): they never recomputed a layer
EVAL_MODE_RUNS = {
    ("h200-fp8-lora-routed-2026-12-02.json", "bf16"),
    ("h200-fp8-lora-routed-ckpt-2026-12-02.json", "bf16-ckpt1"),
}
FP8_ROWS = [r for r in FP8_ALL if (r["file"], r["label"]) not in EVAL_MODE_RUNS]
#: routed-expert adapters: the plan is 10-17% over on the three H200 runs (docs/planner.md "LoRA"); kept
#: here, strict, so that fixing the model turns them into failures to move back among the others
ROUTED_MISS = (
    "the plan's memory for routed-expert adapters is 10-17% high on the H200 (docs/planner.md 'LoRA')"
)


def _fp8_id(r: dict) -> str:
    return f"{r['file'].removesuffix('.json')}:{r['label']}"


def _fp8_case(r: dict):
    routed = any("routed_experts" in s for s in r["sets"])
    miss = pytest.mark.xfail(strict=True, raises=AssertionError, reason=ROUTED_MISS)
    return pytest.param(r, id=_fp8_id(r), marks=[miss] if routed else [])


def test_the_fp8_base_runs_cover_both_bases_and_a_full_run():
    labels = {(r["layers"], r["label"]) for r in FP8_ROWS}
    assert {(27, "fp8"), (27, "bf16"), (27, "fp8-mb4"), (2, "full"), (2, "bf16")} <= labels
    files = {r["file"] for r in FP8_ALL}
    assert {f for f, _ in EVAL_MODE_RUNS} <= files  # the exclusions name runs that exist


@pytest.mark.parametrize("row", [_fp8_case(r) for r in FP8_ROWS])
def test_fp8_base_memory_matches_measurement(row):
    predicted = fp8_repredict(row)
    assert predicted["memory_gib"] == pytest.approx(row["measured"]["peak_reserved_gib"], rel=0.10), row[
        "plan"
    ]


@pytest.mark.parametrize("row", FP8_ROWS, ids=_fp8_id)
def test_fp8_base_speed_matches_measurement(row):
    predicted = fp8_repredict(row)
    want = row["measured"]["tokens_per_s_per_gpu"]
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(want, rel=0.15), row["plan"]


def _fp8_default_targets(r: dict) -> bool:
    return "finetune.base_precision=fp8" in r["sets"] and not any("routed_experts" in s for s in r["sets"])


@pytest.mark.parametrize("row", [r for r in FP8_ROWS if _fp8_default_targets(r)], ids=_fp8_id)
def test_an_fp8_bases_construction_is_the_ranks_fp8_share(row):
    """Built from the meta device: what the allocator held once the engine was built is the plan's count.
    (Without routed adapters: the engine also allocates ZeRO's fp32 master copy and gradient buffer of
    what trains, 2 GiB for 276 M routed adapters, which the plan counts in the steady state instead.)"""
    predicted = fp8_repredict(row)["construction_alloc_gib"]
    assert predicted == pytest.approx(row["measured"]["construction"]["peak_alloc_gib"], rel=0.10), row[
        "plan"
    ]


def test_an_fp8_base_trains_the_loss_curve_of_its_bf16_base():
    """The same checkpoint, held in FP8 or dequantised to bf16, the same targets and batches: the same
    bf16 weights, so the curves differ only by kernel order (micro-batch, compiled attention)."""

    def key(r: dict) -> tuple:  # the step count too: it sets the learning-rate schedule
        targets = next(s for s in r["sets"] if s.startswith("finetune.lora.targets="))
        return r["layers"], targets, len(r["measured"]["losses"])

    bf16 = {
        key(r): r["measured"]["losses"]
        for r in FP8_ROWS
        if r["label"].startswith("bf16") and r["layers"] == 27
    }
    pairs = [(r, bf16[key(r)]) for r in FP8_ROWS if r["label"].startswith("fp8") and key(r) in bf16]
    assert len({key(r) for r, _ in pairs}) == 2  # default targets and routed experts too
    for r, want in pairs:
        assert r["measured"]["losses"] == pytest.approx(want, rel=2e-3), (r["file"], r["label"])


def test_a_lora_checkpoint_is_a_fraction_of_the_full_runs():
    """The LoRA checkpoint goal (<= 5%), measured at V2-Lite's width: the L2 model's LoRA and full checkpoints."""
    size = {r["label"]: r["measured"]["checkpoint_bytes"] for r in FP8_ROWS if r["layers"] == 2}
    assert size["bf16"] <= 0.05 * size["full"]


# ---------------------------------------------------------------------------------------------------
# ZeRO-3's optimizer offload beside the same run resident (`plan_bench.py --set OFFLOAD`): the
# CPU Adam rate per core was fitted on the three offloaded rows. The call's two runs of DeepSpeed's
# partial offload are kept in the file and out of these tests: the plan does not take it (docs/planner.md
# "Optimizer offload, measured")

OFFLOAD_ROWS = [r for r in calibration.rows(PLAN_BENCH, "offload") if not r["_partial_offload"]]
#: the fully offloaded 8-layer run is 12% under the plan's memory; the 4-layer shape is 8% under both
#: resident and offloaded: the activations the model counts at these shapes (docs/planner.md
#: "Optimizer offload, measured")
OFFLOAD_MEMORY_MISS = {
    "L8 s4096 gb8 offload": "the activations at 8 layers, micro-batch 4: 12% under the plan"
}


def test_the_offload_runs_cover_offloaded_and_resident():
    offloaded = {"overrides.offload_optimizer=cpu" in r["overrides"] for r in OFFLOAD_ROWS}
    assert offloaded == {True, False} and len(OFFLOAD_ROWS) >= 3 and all(r["gpus"] == 1 for r in OFFLOAD_ROWS)


@pytest.mark.parametrize("row", OFFLOAD_ROWS, ids=lambda r: r["config"])
def test_offload_speed_matches_measurement(row):
    predicted, summary = repredict(row)
    want = row["measured"]["tokens_per_s_per_gpu"]
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(want, rel=0.15), summary


def _offload_memory_case(r: dict):
    why = OFFLOAD_MEMORY_MISS.get(r["config"])
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=why)] if why else []
    return pytest.param(r, id=r["config"], marks=marks)


@pytest.mark.parametrize("row", [_offload_memory_case(r) for r in OFFLOAD_ROWS])
def test_offload_memory_matches_measurement(row):
    predicted, summary = repredict(row)
    assert predicted["memory_gib"] == pytest.approx(row["measured"]["peak_reserved_gib"], rel=0.10), summary


# ---------------------------------------------------------------------------------------------------
#: 4-layer V2-Lite at micro-batch 1 and 2, seq 2048 and 4096, and global batch 16, beside torchtitan
#: (bench/peer_bench.py), measured since the fused step became one pass: where the host, not the
#: GPU, sets the pace. Today's plan for each shape at the micro-batch it ran.
PEER_BENCH = "peer_bench.py"
SMALL_ROWS = calibration.rows(PEER_BENCH, "small-shapes")
#: measured before the gradients went flat (bench/runs.py `trainer_at`), where activations set the peak,
#: the plan of that trainer is 10-13% high: ACTIVATION_SLACK was fitted on peaks reserved while DeepSpeed's
#: step also allocated an fp32 copy of the gradient partition, which the one pass no longer does. Today's
#: trainer, measured since, is 7-9% under the plan on every shape
SMALL_MEMORY_HIGH = {"L4 s4096 mb2", "L4 s4096 gb16"}


def _small_memory_high(r: dict) -> bool:
    return r["shape"] in SMALL_MEMORY_HIGH and r["_trainer"] != "flat"


def _small_id(r: dict) -> str:
    return f"{r['_source'].split('/')[-1].removesuffix('.json')}:{r['shape']}"


def test_the_small_shapes_cover_micro_batch_1_and_2_at_both_lengths():
    shapes = {(r["seq_len"], r["micro_batch"]) for r in SMALL_ROWS}
    assert {(2048, 1), (2048, 2), (4096, 1), (4096, 2)} <= shapes


@pytest.mark.parametrize("row", SMALL_ROWS, ids=_small_id)
def test_small_shape_speed_matches_measurement(row):
    predicted = calibration.predicted(PEER_BENCH, row)["_predicted"]
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(row["tok_s_gpu"], rel=0.15), predicted


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            r,
            marks=pytest.mark.xfail(
                _small_memory_high(r), strict=True, reason="the plan's memory 10-13% high here"
            ),
        )
        for r in SMALL_ROWS
    ],
    ids=_small_id,
)
def test_small_shape_memory_matches_measurement(row):
    predicted = calibration.predicted(PEER_BENCH, row)["_predicted"]
    assert predicted["memory_gib"] == pytest.approx(row["peak_gib"], rel=0.10), predicted


# ---------------------------------------------------------------------------------------------------
#: V2-Lite at 3-6 layers, micro-batch 1 and 2, seq 1024-4096, one micro-batch a step, beside torchtitan,
#: since a GPU's log records went a step late (bench/runs.py DEFERRED_LOGS_SINCE): one rank's step waits
#: for nothing, and its optimizer overlaps the next step (speed.OPTIMIZER_OVERLAPS_NEXT_STEP). Measured on
#: an H100 80GB and re-predicted on that GPU's profile (`_gpu`). Held to the issue's 10%, not 15%.
LATE_ROWS = calibration.rows(PEER_BENCH, "host-bound-late")


def test_the_late_record_runs_cover_micro_batch_1_and_2_and_three_lengths():
    assert {r["micro_batch"] for r in LATE_ROWS} == {1, 2}
    assert {r["seq_len"] for r in LATE_ROWS} == {1024, 2048, 4096}
    assert all(r["_gpu"] == "h100-80gb" for r in LATE_ROWS)


@pytest.mark.parametrize("row", LATE_ROWS, ids=_small_id)
def test_late_record_speed_matches_measurement(row):
    predicted = calibration.predicted(PEER_BENCH, row)["_predicted"]
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(row["tok_s_gpu"], rel=0.10), predicted


@pytest.mark.parametrize("row", LATE_ROWS, ids=_small_id)
def test_late_record_memory_matches_measurement(row):
    predicted = calibration.predicted(PEER_BENCH, row)["_predicted"]
    assert predicted["memory_gib"] == pytest.approx(row["peak_gib"], rel=0.10), predicted


#: the same calls' rows with the records written at their step (`--at-step-logs`)
AT_STEP_ROWS = peer_bench.derived(
    calibration.results("host-bound-late"), predict=False, system="dskit, logs at their step"
)


@pytest.mark.parametrize("row", AT_STEP_ROWS, ids=_small_id)
def test_a_step_that_waits_at_each_record_is_the_model_before_the_late_records(row):
    """Why runs measured before DEFERRED_LOGS_SINCE are re-predicted with the model of then (bench/runs.py
    `as_measured`): the trainer writing each record at its step, in the same calls, is that model's step."""
    before = "2026-12-06T00:00"
    assert before < runs.DEFERRED_LOGS_SINCE
    predicted = peer_bench.repredict(row, before)
    assert predicted["tokens_per_s_per_gpu"] == pytest.approx(row["tok_s_gpu"], rel=0.10), predicted
