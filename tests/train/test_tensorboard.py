"""The trainer's TensorBoard logger on its own (fast): what it writes, read back with TensorBoard's own
event reader, and that a failing or missing writer never stops training. The trainer's events from a
real CPU run are checked in tests/status/test_report.py."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from dskit.train.tensorboard import TB_DIR, TensorBoardLog  # noqa: E402


def rec(step: int) -> dict:
    return {
        "step": step,
        "loss": 5.0 - step,
        "aux_loss": 0.01,
        "lr": 1e-3,
        "tokens_per_s_per_gpu": 100.0,
        "mfu": None,
        "peak_alloc_gib": 1.0,
        "peak_reserved_gib": 1.5,
        "expert_load_max_over_mean": 1.5,
        "expert_load_per_layer": [1.5, 1.25],
        "expert_counts": [[30, 10, 10, 10], [25, 15, 10, 10]],
    }


def read(d) -> EventAccumulator:
    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_scalars_and_per_expert_histograms_read_back(tmp_path):
    tb = TensorBoardLog(tmp_path, enabled=True)
    for s in (1, 2, 3):
        tb.write(rec(s))
    tb.close()
    acc = read(tmp_path / TB_DIR)
    assert [e.value for e in acc.Scalars("train/loss")] == [4.0, 3.0, 2.0]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3]
    assert "perf/mfu" not in acc.Tags()["scalars"]  # no peak FLOP/s: nothing made up
    assert acc.Scalars("experts/max_over_mean/moe_layer_1")[-1].value == 1.25
    h = acc.Histograms("experts/tokens_per_expert/moe_layer_0")[-1]
    assert h.step == 3 and list(h.histogram_value.bucket) == [30, 10, 10, 10]


def test_rank_other_than_0_writes_nothing(tmp_path):
    tb = TensorBoardLog(tmp_path, enabled=False)
    tb.write(rec(1))
    tb.close()
    assert not (tmp_path / TB_DIR).exists()


def test_a_failing_writer_warns_once_and_training_goes_on(tmp_path, caplog):
    tb = TensorBoardLog(tmp_path, enabled=True)

    class Broken:
        def add_scalar(self, *a, **k):
            raise OSError("disk full")

        def close(self):
            raise OSError("disk full")

    tb.writer = Broken()
    with caplog.at_level(logging.WARNING, logger="dskit.train"):
        for s in (1, 2, 3):
            tb.write(rec(s))  # never raises
        tb.close()
    assert [r.message for r in caplog.records if "TensorBoard" in r.message] == [
        "TensorBoard logger off after an error (training goes on): OSError('disk full')"
    ]


def test_without_the_tensorboard_package_one_warning(tmp_path, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.WARNING, logger="dskit.train"):
        tb = TensorBoardLog(tmp_path, enabled=True)
        tb.write(rec(1))
        tb.close()
    assert len(caplog.records) == 1 and "pip install tensorboard" in caplog.records[0].message
