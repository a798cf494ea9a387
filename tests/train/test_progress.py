"""Rank 0's progress (fast): the ETA, and a bar only on a terminal."""

from __future__ import annotations

import io
import logging

import pytest

pytest.importorskip("tqdm")

from dskit.train.progress import Progress, format_eta, throughput_text  # noqa: E402


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eta_is_measured_from_the_end_of_the_first_step():
    p = Progress(10, 110, enabled=True, stream=io.StringIO())
    p.step(11, now=100.0)  # a resumed process: its first step (start-up included) is not timed
    assert p.eta_s(11, now=100.0) is None
    p.step(12, now=102.0)
    assert p.eta_s(21, now=120.0) == pytest.approx(2.0 * (110 - 21))
    assert p.bar is None  # not a terminal: the log line carries the ETA


@pytest.mark.parametrize(("s", "text"), [(None, "?"), (9.6, "10s"), (125, "2m05s"), (3 * 3600 + 61, "3h01m")])
def test_format_eta(s, text):
    assert format_eta(s) == text


def test_a_terminal_gets_a_bar_with_loss_and_throughput_and_log_lines_above_it():
    term = Terminal()
    p = Progress(0, 4, enabled=True, stream=term)
    for step in (1, 2):
        p.step(step)
    # the bar shows real tokens (padding is no useful work), not the computed figure
    p.logged({"loss": 3.25, "tokens_per_s_per_gpu": 1500.0, "real_tokens_per_s_per_gpu": 1234.0})
    logging.getLogger("dskit.train").warning("a log line")
    p.close()
    out = term.getvalue()
    assert "2/4" in out and "loss=3.2500" in out and "tok_s_gpu=1234" in out


def test_other_ranks_get_no_bar():
    assert Progress(0, 4, enabled=False, stream=Terminal()).bar is None


def test_status_and_report_show_real_tokens_beside_the_padded_figure():
    assert throughput_text({"tokens_per_s_per_gpu": 1500.0}) == "1,500"  # a record from before real tokens
    full = {"tokens_per_s_per_gpu": 1500.0, "real_tokens_per_s_per_gpu": 1500.0, "packing_efficiency": 1.0}
    assert throughput_text(full) == "1,500"
    pad = {"tokens_per_s_per_gpu": 1500.0, "real_tokens_per_s_per_gpu": 150.0, "packing_efficiency": 0.1}
    assert throughput_text(pad) == "150 real (1,500 with padding; rows 10% full)"
    assert throughput_text({}) == "-"
