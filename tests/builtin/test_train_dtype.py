"""The task model's training dtype: bf16 only where it is measured clearly faster, decided once per machine."""

import json

import pytest
import torch

from twospeed.builtin import train_dtype


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TWOSPEED_CACHE", str(tmp_path))
    monkeypatch.setattr(train_dtype, "cpu_computes", lambda dtype: True)
    return tmp_path


def timer(bf16: float, float32: float, calls: list):
    def measure(dtype: torch.dtype, threads: int) -> float:
        calls.append((dtype, threads))
        return bf16 if dtype == torch.bfloat16 else float32
    return measure


@pytest.mark.parametrize("bf16, float32, expected", [(0.5, 1.0, True), (0.8, 1.0, True), (0.9, 1.0, False),
                                                      (2.0, 1.0, False)])
def test_bf16_only_where_it_clearly_wins(cache, bf16, float32, expected):
    calls = []
    assert train_dtype.train_in_bf16(2, timer(bf16, float32, calls)) is expected
    assert sorted(str(dt) for dt, _ in calls) == ["torch.bfloat16", "torch.float32"]
    assert all(threads == 2 for _, threads in calls)


def test_a_machine_decides_once_per_thread_count(cache):
    calls = []
    assert train_dtype.train_in_bf16(2, timer(0.5, 1.0, calls))
    assert train_dtype.train_in_bf16(2, timer(2.0, 1.0, calls))  # read back, not measured again
    assert len(calls) == 2
    assert not train_dtype.train_in_bf16(1, timer(2.0, 1.0, calls))  # another thread count is another question
    assert len(calls) == 4
    record = json.loads((cache / train_dtype.RECORD).read_text())
    assert record[train_dtype.machine_key(2)] == {"bfloat16": 0.5, "float32": 1.0, "bf16": True}
    assert record[train_dtype.machine_key(1)]["bf16"] is False


def test_no_bf16_kernels_means_float32_without_measuring(cache, monkeypatch):
    monkeypatch.setattr(train_dtype, "cpu_computes", lambda dtype: dtype == torch.float32)
    calls = []
    assert not train_dtype.train_in_bf16(2, timer(0.1, 1.0, calls))
    assert calls == [] and not (cache / train_dtype.RECORD).exists()


def test_a_damaged_record_is_measured_again(cache):
    (cache / train_dtype.RECORD).write_text("{not json")
    calls = []
    assert train_dtype.train_in_bf16(2, timer(0.5, 1.0, calls))
    assert len(calls) == 2


def test_product_time_times_the_product_and_restores_threads(monkeypatch):
    monkeypatch.setattr(train_dtype, "SHAPE", (64, 32, 48))
    before = torch.get_num_threads()
    seconds = train_dtype.product_time(torch.float32, 1, repeats=3)
    assert 0 < seconds < 1
    assert torch.get_num_threads() == before
