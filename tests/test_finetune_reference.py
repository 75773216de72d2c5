"""Offline reference (c): the whole Lite0 fine-tuned i.i.d. on the stream's photos (`clients.bench.stream.finetune`),
on a slice of real Split EuroSAT tiles; a run stopped after an epoch goes on from its state."""

import json

from clients.bench.stream.finetune import main

from .conftest import EUROSAT_ZIP


def run(tmp_path, cache_dir, epochs: int, out: str) -> dict:
    assert main(["--dataset", "eurosat", "--data", str(EUROSAT_ZIP), "--train-per-class", "8", "--test-per-class",
                 "4", "--input-size", "64", "--batch-size", "16", "--epochs", str(epochs), "--cache-dir",
                 str(cache_dir), "--state", str(tmp_path / "state.pt"), "--out", str(tmp_path / out)]) == 0
    return json.loads((tmp_path / out).read_text())


def test_the_whole_network_trains_and_a_stopped_run_goes_on_from_its_last_epoch(tmp_path, cache_dir):
    first = run(tmp_path, cache_dir, 1, "one.json")
    assert first["reference"] == "finetune-whole" and len(first["epochs"]) == 1 and first["train_samples"] == 80
    resumed = run(tmp_path, cache_dir, 2, "two.json")  # the state after epoch 1: epoch 2 alone runs
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2] and resumed["epochs"][0] == first["epochs"][0]
    assert resumed["train_cpu_seconds"] > first["train_cpu_seconds"] > 0
    assert resumed["epochs"][1]["train_loss"] < resumed["epochs"][0]["train_loss"]  # it learns the tiles
    assert len(resumed["accuracy_by_task"]) == 5 and resumed["average_accuracy"] > 20.0  # chance: 10%
    assert "python -m clients.bench.stream.finetune" in resumed["command"]
