"""The real trainer on CPU: DeepSpeed ZeRO-3 + AutoEP (EP=2) on 2 gloo ranks, tiny V2 and V3 models.

Each launch is `dskit train --local RUN_DIR`, the README's path. Runs are shared per module to stay
inside CI's budget: one uninterrupted reference run per architecture, then interrupted variants that
must reproduce its per-step losses exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dskit.launch.contract import COMPLETE_FILE, EXIT_REQUEUE, STOP_FILE
from dskit.plan.memory import LOSS_CHUNK_TOKENS
from dskit.plan.schema import load_plan
from dskit.train.profile import COMMUNICATION, host_table
from tests.conftest import dskit, render_tiny, status_table
from tests.support.cli import cli
from tests.support.warm_ranks import rank_pid

pytestmark = pytest.mark.train
STEPS = 40


#: bench/log_hook: the ranks write their log records a step late, as GPU ranks do, and say so on stderr
LATE_RECORDS = {
    "PYTHONPATH": os.pathsep.join(
        x
        for x in (
            str(Path(__file__).resolve().parents[2] / "bench" / "log_hook"),
            os.environ.get("PYTHONPATH"),
        )
        if x
    ),
    "DSKIT_BENCH_LOG_RECORDS": "late",
}


def start(run_dir: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    f = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "dskit", "train", "--local", str(run_dir)],
        stdout=f,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def run(run_dir: Path, log: Path, timeout: float = 600, env: dict[str, str] | None = None) -> int:
    p = start(run_dir, log, env)
    try:
        return p.wait(timeout=timeout)
    finally:
        p.kill()


def losses(run_dir: Path) -> dict[int, float]:
    plan = load_plan(run_dir / "run.yaml")
    f = Path(plan.run.output_dir) / "metrics.jsonl"
    out: dict[int, float] = {}
    if f.is_file():
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]  # a resumed run's record replaces an earlier one
    return out


def records(run_dir: Path) -> list[dict]:
    plan = load_plan(run_dir / "run.yaml")
    return [json.loads(x) for x in (Path(plan.run.output_dir) / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    t0 = time.time()
    while max(losses(run_dir), default=0) < step:
        assert proc.poll() is None, "trainer ended early"
        assert time.time() - t0 < timeout, "no progress"
        time.sleep(0.2)


def ranks_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The trainer ranks under torchrun (not torchrun itself), by rank. Other children come and go
    (DeepSpeed's op builder runs the compiler while a rank starts): one that has exited is skipped. A
    rank forked from the suite's zygote is found behind the shim torchrun started
    (tests/support/warm_ranks.py)."""

    def described(k: psutil.Process) -> tuple[str, int]:
        try:
            return " ".join(k.cmdline()), int(k.environ().get("RANK", "-1"))
        except psutil.Error:  # exited (a zombie, or gone) since children() listed it
            return "", -1

    found = []
    for k in psutil.Process(proc.pid).children(recursive=True):
        cmd, rank = described(k)
        if "dskit.train" in cmd and "dskit.launch.torchrun" not in cmd:
            found.append((rank, k.pid))
    return [psutil.Process(rank_pid(pid)) for _, pid in sorted(found)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """`dskit data prepare` over real text (the embedded corpus written out as .txt and .jsonl)."""
    from dskit.data.corpus import embedded_corpus

    d = tmp_path_factory.mktemp("data")
    docs = embedded_corpus()
    (d / "a.txt").write_text("\n\n".join(docs[: len(docs) // 2]))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[len(docs) // 2 :]))
    cli("data", "prepare", str(d / "a.txt"), str(d / "b.jsonl"), "-o", str(d / "shards"), check=True)
    return d / "shards"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> dict[str, Path]:
    """One uninterrupted 40-step run per architecture (v2 on the embedded corpus, v3 on prepared shards)."""
    out = {}
    for model in ("tiny-v2", "tiny-v3"):
        tmp = tmp_path_factory.mktemp(model)
        # v2 checkpoints every step so the interrupted runs can be compared file by file
        every = (
            ["checkpoint.every=1", "checkpoint.keep=100"] if model == "tiny-v2" else ["checkpoint.every=10"]
        )
        extra = every + ([f"data.path={shards}"] if model == "tiny-v3" else [])
        rd = render_tiny(tmp, model, steps=STEPS, extra=extra)
        rc = run(rd, tmp / "train.log")
        assert rc == 0, (tmp / "train.log").read_text()[-4000:]
        out[model] = rd
    return out


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_loss_falls_on_real_text(reference, model):
    ls = losses(reference[model])
    assert sorted(ls) == list(range(1, STEPS + 1))
    first, last = sum(ls[s] for s in range(1, 6)) / 5, sum(ls[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.8 * first, (first, last)


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_zero3_hooks_see_every_module_output(reference, model):
    """DeepSpeed warns when a module's output hides its tensors from ZeRO-3's backward hooks (the
    chunked loss's LMOutput did, at every start); the reference runs train with the chunked
    loss, so they would show it."""
    assert load_plan(reference[model] / "run.yaml").parallel.loss_chunk_tokens
    log = (reference[model].parent / "train.log").read_text()
    assert "unknown inputs or outputs type" not in log, log[-3000:]


def test_metrics_records_carry_what_the_issue_lists(reference):
    rec = records(reference["tiny-v2"])[-1]
    for key in (
        "loss",
        "lr",
        "tokens_per_s_per_gpu",
        "real_tokens_per_s_per_gpu",
        "packing_efficiency",
        "mfu",
        "peak_alloc_gib",
        "peak_reserved_gib",
        "aux_loss",
        "expert_load_max_over_mean",
        "expert_load_per_layer",
    ):
        assert key in rec
    assert rec["mfu"] is None  # the cpu profile has no peak FLOP/s: no made-up MFU
    # text windows are all real tokens: the honest figure is the computed one
    assert (
        rec["packing_efficiency"] == 1.0 and rec["real_tokens_per_s_per_gpu"] == rec["tokens_per_s_per_gpu"]
    )
    assert rec["aux_loss"] > 0 and len(rec["expert_load_per_layer"]) == 2  # tiny models: 2 MoE layers
    counts = rec["expert_counts"]  # [layer][expert] tokens routed in the log window, all ranks
    assert len(counts) == 2 and all(isinstance(c, int) and c >= 0 for row in counts for c in row)
    plan = load_plan(reference["tiny-v2"] / "run.yaml")
    par, top_k = plan.parallel, plan.model.config["num_experts_per_tok"]
    routed = par.micro_batch * par.grad_accum * par.seq_len * plan.hardware.world_size * top_k
    assert [sum(row) for row in counts] == [routed] * 2  # log_every=1: one step's tokens x top-k per layer
    mean = sum(counts[0]) / len(counts[0])
    assert max(counts[0]) / mean == pytest.approx(rec["expert_load_per_layer"][0], abs=1e-3)
    assert (Path(plan.run.output_dir) / COMPLETE_FILE).is_file()


def test_status_shows_a_finished_local_run_as_it_shows_a_cluster_run(reference):
    """The README's demo path: `dskit train --local RUN_DIR`, then `dskit status RUN_DIR` (no scheduler
    asked: the launcher's record says how the run went, the run's files the rest)."""
    rd = reference["tiny-v2"]
    r = cli("status", str(rd), env={"PATH": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    rows = status_table(r.stdout)
    assert rows["state"].startswith("finished: dskit train --local, exit 0, ran "), rows
    assert rows["step"].startswith(f"{STEPS} / {STEPS} (complete), logged ")
    assert rows["loss"] == f"{losses(rd)[STEPS]:.4f}" and rows["ETA"] == "done"
    assert re.search(rf"/step{STEPS:08d} \(step {STEPS}, .* ago\)$", rows["last checkpoint"]), rows


def test_cpu_log_lines_leave_out_the_mfu_a_cpu_has_none_of(reference):
    """A CPU profile has no peak FLOP/s, so no MFU: the log line leaves it out instead of `mfu None`."""
    lines = [x for x in (reference["tiny-v2"].parent / "train.log").read_text().splitlines() if " step " in x]
    assert len([x for x in lines if f"/{STEPS} loss " in x]) == STEPS
    assert not [x for x in lines if "None" in x], lines[:3]


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_export_round_trip(reference, model, tmp_path):
    from transformers import AutoModelForCausalLM

    rd = reference[model]
    hf = tmp_path / "hf"
    r = dskit("export", str(rd), "-o", str(hf), check=True)
    assert "verified" in r.stdout
    # independently of export's own check: transformers loads it and reproduces the trained logits
    plan = load_plan(rd / "run.yaml")
    probe = torch.load(Path(plan.run.checkpoint_dir) / f"step{STEPS:08d}" / "probe.pt", weights_only=False)
    m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, local_files_only=True).eval()
    with torch.no_grad():
        got = m(input_ids=probe["input_ids"]).logits.float()
    err = ((got - probe["logits"]).norm() / probe["logits"].norm()).item()
    assert err < 2e-2
    again = dskit("export", str(rd), "-o", str(hf))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_chunked_loss_follows_the_plain_loss_curve(reference, tmp_path):
    """The chunked linear + cross-entropy (no batch x seq x vocab logits, the planner's choice for the
    reference run) trains like the plain full-logits path: same first loss, same curve within bf16
    noise."""
    ref = reference["tiny-v2"]
    assert load_plan(ref / "run.yaml").parallel.loss_chunk_tokens == LOSS_CHUNK_TOKENS
    extra = ["checkpoint.every=1", "checkpoint.keep=100", "overrides.loss=full"]
    rd = render_tiny(tmp_path, "tiny-v2", steps=STEPS, extra=extra)
    assert load_plan(rd / "run.yaml").parallel.loss_chunk_tokens == 0
    assert run(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    got, want = losses(rd), losses(ref)
    assert sorted(got) == sorted(want)
    assert got[1] == pytest.approx(want[1], rel=1e-4)
    drift = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert drift < CHUNKED_LOSS_RTOL, drift


def test_regional_compile_trains_like_eager(reference, tmp_path):
    """overrides.compile=on routes RMSNorm, SwiGLU and rotary through torch.compile (on CPU too): the same
    math, so the first steps' losses match the eager reference run's to bf16 rounding."""
    ref = reference["tiny-v2"]
    rd = render_tiny(tmp_path, "tiny-v2", steps=4, extra=["overrides.compile=on", "checkpoint.final=false"])
    assert load_plan(rd / "run.yaml").parallel.compile_regions
    assert run(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "regional torch.compile: rms_norm x" in log and "rotary x1" in log, log[-3000:]
    got, want = losses(rd), losses(ref)
    for step in (1, 2, 3):  # the schedule of a 4-step run differs from the 40-step one after step 1's lr
        assert got[step] == pytest.approx(want[step], rel=2e-2), (step, got[step], want[step])
    assert got[1] == pytest.approx(want[1], rel=1e-4)


def test_profile_steps_write_a_time_breakdown_by_category(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2", steps=8, extra=["training.profile_steps=2"])
    assert run(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    out = Path(load_plan(rd / "run.yaml").run.output_dir)
    table = json.loads((out / "profile.json").read_text())
    assert table["steps"] == 2 and table["ms_per_step"] > 0
    cats = table["categories"]
    comm = [c for name, c in cats.items() if name in COMMUNICATION]
    assert cats["GEMM"]["ms_per_step"] > 0 and sum(c["ms_per_step"] for c in comm) > 0
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1, abs=1e-3)
    trace = json.loads((out / "profile-trace.json").read_text())
    host = host_table(trace, table["steps"])
    assert host["launches_per_step"] == 0 and host["cpu_ops_inclusive"]  # CPU: operators, no CUDA launches
    assert "profile of steps 6-7" in (tmp_path / "train.log").read_text()
    # what ran, for benchmarks to compare with the plan: sdpa on CPU, as the plan says for the cpu profile
    ran = json.loads((out / "construction-rank0.json").read_text())["ran"]
    par = load_plan(rd / "run.yaml").parallel
    assert (ran["attention"], ran["optimizer_step"]) == (par.attention, par.optimizer_step)


def test_export_streams_into_many_shards_with_an_index(reference, tmp_path, capsys):
    """Shard by shard, as for a model far larger than this machine: names decided from shapes first,
    an index like a published checkpoint, and transformers loads the result (export verifies it)."""
    from transformers import AutoModelForCausalLM

    from dskit.formats.hf_checkpoint import check_checkpoint
    from dskit.train.export import export

    out = export(str(reference["tiny-v3"]), str(tmp_path / "hf"), shard_bytes=100_000)
    assert "verified" in capsys.readouterr().out
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and all(p.stat().st_size < 100_000 + 2**16 for p in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert len(check_checkpoint(str(out))) == len(index["weight_map"])
    m = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert set(index["weight_map"]) == set(m.state_dict())


def test_the_fp8_export_is_deepseek_v3s_published_format(reference, tmp_path, capsys):
    """`dskit export --fp8`: every projection and routed expert e4m3 with a float32 scale per 128 x 128
    block, the experts one tensor each as V3 is published, the rest in the run's bf16 (the routing bias
    float32), config.json's quantization_config as V3's. dskit's own reader takes it as an FP8 checkpoint,
    and export read every tensor back through transformers within FP8's rounding, and the logits."""
    from dskit.formats.hf_checkpoint import check_checkpoint, fp8_format
    from dskit.train import export_fp8
    from dskit.train.export import export

    rd = reference["tiny-v3"]
    out = export(str(rd), str(tmp_path / "fp8"), fp8=True)
    said = capsys.readouterr().out
    assert "tensors read back by transformers within FP8's rounding" in said, said
    assert "exported logits match the trained model" in said, said
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    tensors = check_checkpoint(str(out))  # V3's rules: every FP8 weight has its scale, of its block grid
    fmt = fp8_format(str(out))
    projections = {n for n in tensors if re.search(r"_proj(_with_mqa)?\.weight$", n)}
    assert set(fmt.weights) == projections
    assert {(tensors[n][0], tensors[fmt.scale_of(n)][0]) for n in projections} == {("F8_E4M3", "F32")}
    model = load_plan(rd / "run.yaml").model.config
    experts = [n for n in projections if re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.", n)]
    moe_layers = model["num_hidden_layers"] - model["first_k_dense_replace"]
    assert len(experts) == moe_layers * model["n_routed_experts"] * 3
    rest = {n: dt for n, (dt, _) in tensors.items() if n not in projections and not n.endswith("_scale_inv")}
    bias = {n for n in rest if n.endswith("e_score_correction_bias")}
    assert bias and {rest[n] for n in bias} == {"F32"}
    assert {dt for n, dt in rest.items() if n not in bias} == {"BF16"}  # embedding, norms, router, head
    # the read-back check fails where a tensor lands in another's place (gate for up), which the logits
    # of a briefly trained tiny model barely show
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, local_files_only=True
    ).state_dict()
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in loaded.items()}
    assert export_fp8.check_weights(out, shapes, lambda n, shape, dt: loaded[n]) == len(loaded)
    fused = next(n for n in loaded if n.endswith("experts.gate_up_proj"))

    def swapped(n, shape, dt):
        return loaded[n].roll(loaded[n].shape[1] // 2, dims=1) if n == fused else loaded[n]

    with pytest.raises(RuntimeError, match=re.escape(f"the FP8 export's {fused} reads back")):
        export_fp8.check_weights(out, shapes, swapped)
    refused = dskit("export", str(rd), "-o", str(tmp_path / "a"), "--fp8", "--adapter-only")
    assert refused.returncode == 2 and refused.stderr.startswith("dskit: error: --fp8: ")
    assert len(refused.stderr.splitlines()) == 1 and not (tmp_path / "a").exists()


# Resumed runs match the uninterrupted run to this relative tolerance, not bit for bit. Measured: the
# checkpoint a stopped run writes is byte-identical to the uninterrupted run's at the same step (asserted
# below), yet DeepSpeed's freshly loaded ZeRO-3 + AutoEP engine (0.19.8, CPU) computes steps that differ
# by 1e-7..1e-4 relative from the second or third step on, whether the checkpoint came from a stop or
# from a periodic save. 1e-3 is 10x the largest drift seen over 25 resumed steps and 10x below the
# typical step-to-step change in loss, so a wrong resume (lost step, wrong data, stale optimizer) fails.
RESUME_RTOL = 1e-3
# Chunked vs plain loss: the same GEMMs and fp32 softmax, but the weight gradient is summed in another
# order; bf16 rounding differences then compound over 40 steps of lr 3e-3. Measured: see the test.
CHUNKED_LOSS_RTOL = 2e-2


def stop_with_sigterm(
    run_dir: Path, log: Path, at_step: int, rank: int = 0, env: dict[str, str] | None = None
) -> int:
    """Start the run, send SIGTERM to one rank once `at_step` is logged, and return the last step
    logged: the trainer must checkpoint and exit 75 (requeue)."""
    p = start(run_dir, log, env)
    try:
        wait_for_step(run_dir, p, at_step)
        ranks_of(p)[rank].send_signal(signal.SIGTERM)
        p.wait(timeout=300)
    finally:
        p.kill()
    text = log.read_text()
    assert "exiting with 75 (requeue)" in text, text[-3000:]
    return max(losses(run_dir))


def assert_same_run(got: dict[int, float], want: dict[int, float], exact_until: int) -> None:
    assert sorted(got) == sorted(want)
    for s in want:
        if s <= exact_until:
            assert got[s] == want[s], s
        else:
            assert got[s] == pytest.approx(want[s], rel=RESUME_RTOL), s


def _state_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.glob("*zero_pp_rank_*.pt")}


def test_sigterm_then_resume_continues_the_uninterrupted_run(reference, tmp_path):
    """Stopped and resumed with the log records a step late, as a GPU writes them (the reference wrote
    each at its step): the same record for every step, none lost at the stop or the end."""
    ref = reference["tiny-v2"]
    ref_ckpt = Path(load_plan(ref / "run.yaml").run.checkpoint_dir)
    rd = render_tiny(tmp_path, "tiny-v2", steps=STEPS, extra=["checkpoint.every=10"])
    # one rank only: the stop must reach all of them
    stopped = stop_with_sigterm(rd, tmp_path / "a.log", 15, rank=-1, env=LATE_RECORDS)
    assert (tmp_path / "a.log").read_text().count("bench/log_hook: log records late") == 2
    plan = load_plan(rd / "run.yaml")
    saved = Path(plan.run.checkpoint_dir) / f"step{stopped:08d}"
    assert (saved / "dskit.json").is_file() and stopped < STEPS  # at most the current step is lost
    assert _state_files(saved) == _state_files(ref_ckpt / saved.name)  # byte-identical state

    assert run(rd, tmp_path / "b.log", env=LATE_RECORDS) == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert f"resumed from {saved}" in (tmp_path / "b.log").read_text()
    assert (tmp_path / "b.log").read_text().count("bench/log_hook: log records late") == 2
    assert_same_run(losses(rd), losses(ref), exact_until=stopped)
    assert [r["step"] for r in records(rd)] == list(range(1, STEPS + 1))  # each once, in order

    # A damaged newest checkpoint is detected and the previous one is used.
    final = Path(plan.run.checkpoint_dir) / f"step{STEPS:08d}"
    victim = next(final.glob("bf16_zero_pp_rank_1_*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (Path(plan.run.output_dir) / COMPLETE_FILE).unlink()
    assert run(rd, tmp_path / "c.log") == 0
    log_c = (tmp_path / "c.log").read_text()
    assert (
        f"step{STEPS:08d} cannot be trusted: rank 1: {victim.name} corrupt (checksum mismatch); falling back "
        "to the previous complete one"
    ) in log_c
    assert f"resumed from {plan.run.checkpoint_dir}/step{STEPS - 10:08d}" in log_c
    assert_same_run(losses(rd), losses(ref), exact_until=stopped)


def test_usr1_to_the_launcher_checkpoints_and_exits_for_requeue(tmp_path):
    """USR1 to `dskit train --local` creates STOP, as the Slurm batch script's trap does (torchrun does
    not forward USR1): every rank checkpoints at the next step and the launcher exits 75."""
    rd = render_tiny(tmp_path, "tiny-v2", steps=STEPS)
    plan = load_plan(rd / "run.yaml")
    p = start(rd, tmp_path / "a.log")
    try:
        wait_for_step(rd, p, 3)
        running = status_table(cli("status", str(rd), check=True).stdout)
        p.send_signal(signal.SIGUSR1)
        rc = p.wait(timeout=300)
    finally:
        p.kill()
    log = (tmp_path / "a.log").read_text()
    assert "SIGUSR1 received; asking ranks to checkpoint" in log, log[-3000:]
    assert rc == EXIT_REQUEUE, log[-3000:]  # `--local` relays the ranks' own code, as cluster entrypoints do
    # `dskit status` followed it: running under the launcher's pid, then stopped to be resumed
    assert running["state"].startswith(f"running: dskit train --local, pid {p.pid} on "), running
    assert running["ETA"] not in ("done", "- (not running)")
    stopped_row = status_table(cli("status", str(rd), check=True).stdout)["state"]
    assert stopped_row.startswith("stopped: dskit train --local, checkpointed on request (exit 75)")
    stopped = max(losses(rd))
    assert (Path(plan.run.checkpoint_dir) / f"step{stopped:08d}" / "dskit.json").is_file()
    assert not (Path(plan.run.checkpoint_dir) / STOP_FILE).exists()  # consumed, so a requeue runs on


def rank0_alone(run_file: Path) -> subprocess.CompletedProcess:
    """`python -m dskit.train` as rank 0 of 2 with the launch contract's env and no peer: input checks
    that run before the process group forms must answer on their own (one line, exit 2)."""
    env = {**os.environ, "DSKIT_RUN_FILE": str(run_file), "DSKIT_GPU_PROFILE": "cpu"}
    env.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    return subprocess.run([sys.executable, "-m", "dskit.train"], env=env, capture_output=True, text=True)


def test_bad_run_yaml_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("version: 1\nname: [oops\n")
    r = rank0_alone(bad)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not valid YAML" in r.stderr


def test_status_shows_a_local_run_that_failed(tmp_path):
    """A local run whose ranks refuse their input: the launcher relays exit 2, its record says so."""
    rd = render_tiny(tmp_path, "tiny-v2", extra=[f"data.path={tmp_path / 'nope'}"])
    assert run(rd, tmp_path / "train.log") == 2, (tmp_path / "train.log").read_text()[-3000:]
    rows = status_table(cli("status", str(rd), check=True).stdout)
    assert rows["state"].startswith(
        "failed: dskit train --local, bad input (exit 2): the error line is in its output"
    )
    assert rows["step"].startswith("- / 40 (no metrics in") and rows["last checkpoint"].startswith("none yet")


def test_missing_data_is_one_line_and_exit_2(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2", extra=[f"data.path={tmp_path / 'nope'}"])
    r = rank0_alone(rd / "run.yaml")
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip() == f"dskit: error: data.path: {tmp_path / 'nope' / 'index.json'} not found; "
        "create shards with `dskit data prepare`"
    )


def test_an_interrupted_builds_lock_is_named_before_deepspeed_waits_on_it(tmp_path, monkeypatch):
    """A JIT build killed mid-compile leaves torch's `lock` in the extension's build folder; DeepSpeed's
    CPU collectives (`deepspeed_shm_comm`) then wait on it at start, forever and silently. The trainer
    names the file and its fix first, so the log of a run that hangs there says why."""
    from tests.support.build_lock import plant

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    lock = plant("deepspeed_shm_comm")  # where DeepSpeed's build of its CPU collectives waits
    rd = render_tiny(tmp_path, "tiny-v2", gpus_per_node=1)
    log = tmp_path / "train.log"
    p = start(rd, log)
    try:
        t0 = time.time()
        while "a torch extension build lock" not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.time() - t0 < 300, "the trainer never reached DeepSpeed's start"
            time.sleep(0.2)
    finally:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        p.wait()
    line = next(ln for ln in log.read_text().splitlines() if "a torch extension build lock" in ln)
    assert f"{lock}: a torch extension build lock no process on this host holds" in line
    assert f"rm -f {lock} " in line
    assert "rank 0 of 1" not in log.read_text()  # said before the process group's start, where it waits


@pytest.mark.parametrize("stage", [2, 3])
def test_run_yaml_edited_to_flat_gradients_on_two_ranks_is_one_line_and_exit_2(tmp_path, stage):
    """`parallel.gradients: flat` is the plan's for one rank only: written by hand into a 2-rank run.yaml
    (the fused step of ZeRO-2, DeepSpeed's step of ZeRO-3) the trainer names the field and exits 2."""
    import yaml

    rd = render_tiny(tmp_path, "tiny-v2", steps=2, extra=[f"overrides.zero_stage={stage}"])
    data = yaml.safe_load((rd / "run.yaml").read_text())
    assert data["parallel"]["gradients"] == "buckets"
    data["parallel"]["gradients"] = "flat"
    (rd / "run.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    log = tmp_path / "train.log"
    assert run(rd, log) == 2, log.read_text()[-3000:]
    errors = [
        ln for ln in log.read_text().splitlines() if ln.startswith("dskit: error: parallel.gradients: ")
    ]
    assert errors and ("2 ranks" in errors[0] if stage == 2 else "only with the fused step" in errors[0])
    assert not losses(rd)


def test_local_launch_refuses_a_world_size_the_plan_was_not_made_for(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2")
    r = dskit("train", "--local", str(rd), "--nproc", "3")
    assert r.returncode == 2 and "--nproc" in r.stderr
