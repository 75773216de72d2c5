"""A benchmark run cut off between two tasks goes on from its checkpoint and ends where an
uninterrupted run ends (real CIFAR-10 slices, real processes, a real SIGKILL)."""

import json
import subprocess
import sys
import time

import pytest
import torch

from clients.bench.benchmark import build_parser, main
from clients.bench.stream.protocol import run_once
from clients.bench.stream.resume import CheckpointMismatch, load_run_state, run_identity
from learner.data import load_dataset

from .conftest import CIFAR10_ZIP, ROOT

SLICE = ["--dataset", "cifar10", "--data", str(CIFAR10_ZIP), "--train-per-class", "100", "--test-per-class", "20",
         "--mem-size", "50", "--threads", "1", "--quiet"]


def run_args(cache_dir, method, *extra):
    return [*SLICE, "--method", method, "--cache-dir", str(cache_dir), *extra]


def comparable(result: dict) -> dict:
    keys = ("accuracy_matrix", "accuracy_matrix_ncm", "replay_incoming_share", "steps", "settings")
    return {k: result.get(k) for k in keys}


def test_a_killed_run_goes_on_from_its_last_task_and_ends_as_an_uninterrupted_one(tmp_path, cache_dir):
    assert main(["run", *run_args(cache_dir, "er", "--out", str(tmp_path / "whole.json"))]) == 0
    checkpoint = tmp_path / "er.resume.pt"
    cmd = [sys.executable, "-m", "clients.bench.benchmark", "run",
           *run_args(cache_dir, "er", "--out", str(tmp_path / "cut.json"), "--checkpoint", str(checkpoint))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert checkpoint.exists() and not (tmp_path / "cut.json").exists(), "the run was not cut off mid-stream"
    done = torch.load(checkpoint, weights_only=False)["progress"]["done"]
    assert 1 <= done < 5

    assert subprocess.run(cmd, cwd=ROOT, capture_output=True).returncode == 0
    whole, cut = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("whole", "cut"))
    assert comparable(cut) == comparable(whole)
    assert cut["resumed_after_pass"] == [done] and "resumed_after_pass" not in whole
    assert not checkpoint.exists()  # a finished run leaves nothing to resume


def test_aser_mu_resumed_from_its_last_task_gives_the_uninterrupted_result(tmp_path, cache_dir):
    args = build_parser().parse_args(["run", *run_args(cache_dir, "aser-mu")])
    data = load_dataset("cifar10", CIFAR10_ZIP, 100, 20, cache_dir)
    checkpoint = tmp_path / "aser-mu.resume.pt"
    whole = run_once(args, data, 3, progress=False, checkpoint=checkpoint)
    state = load_run_state(checkpoint, run_identity(args, data, 3), data)  # saved after task 4 of 5
    assert state["progress"]["done"] == 4
    stored = torch.load(checkpoint, weights_only=False)["learner"]["buffer"]
    assert "images" not in stored and stored["train_index"].numel() == 50  # indices, not pixels
    assert torch.equal(data.train_y[stored["train_index"]], state["learner"]["buffer"]["labels"])
    resumed = run_once(args, data, 3, progress=False, checkpoint=checkpoint)
    assert comparable(resumed) == comparable(whole) and resumed["resumed_after_pass"] == [4]


def test_an_iid_run_resumes_between_epochs(tmp_path, cache_dir):
    args = build_parser().parse_args(["run", *run_args(cache_dir, "iid-offline", "--epochs", "2")])
    data = load_dataset("cifar10", CIFAR10_ZIP, 100, 20, cache_dir)
    checkpoint = tmp_path / "iid.resume.pt"
    whole = run_once(args, data, 0, progress=False, checkpoint=checkpoint)
    resumed = run_once(args, data, 0, progress=False, checkpoint=checkpoint)
    assert comparable(resumed) == comparable(whole) and resumed["resumed_after_pass"] == [1]
    assert resumed["steps"] == 2 * 100 and len(resumed["accuracy_matrix"]) == 1


def test_another_runs_checkpoint_is_refused_and_kept(tmp_path, cache_dir, capsys):
    args = build_parser().parse_args(["run", *run_args(cache_dir, "er")])
    data = load_dataset("cifar10", CIFAR10_ZIP, 100, 20, cache_dir)
    checkpoint = tmp_path / "er.resume.pt"
    run_once(args, data, 0, progress=False, checkpoint=checkpoint)
    code = main(["run", *run_args(cache_dir, "er", "--lr", "0.05", "--checkpoint", str(checkpoint))])
    assert code == 2 and "lr differ" in capsys.readouterr().err and checkpoint.exists()


def test_a_later_option_is_part_of_the_identity_and_an_older_checkpoint_is_compared_without_it(tmp_path, cache_dir,
                                                                                              capsys):
    args = build_parser().parse_args(["run", *run_args(cache_dir, "er")])
    data = load_dataset("cifar10", CIFAR10_ZIP, 100, 20, cache_dir)
    checkpoint = tmp_path / "er.resume.pt"
    run_once(args, data, 0, progress=False, checkpoint=checkpoint)
    code = main(["run", *run_args(cache_dir, "er", "--optimizer", "adam", "--checkpoint", str(checkpoint))])
    assert code == 2 and "optimizer differ" in capsys.readouterr().err

    state = torch.load(checkpoint, weights_only=False)  # as written before the optimizer was named
    del state["run"]["identity"]
    torch.save(state, checkpoint)
    adam = build_parser().parse_args(["run", *run_args(cache_dir, "er", "--optimizer", "adam")])
    assert load_run_state(checkpoint, run_identity(adam, data, 0), data)["progress"] == state["progress"]
    lr = build_parser().parse_args(["run", *run_args(cache_dir, "er", "--lr", "0.05")])
    with pytest.raises(CheckpointMismatch, match="lr differ"):
        load_run_state(checkpoint, run_identity(lr, data, 0), data)


def test_a_sweep_goes_on_from_the_checkpoint_a_cut_off_session_left(tmp_path, cache_dir):
    from clients.bench.stream.sweep import checkpoint_path, sweep

    grid = tmp_path / "grid.toml"
    grid.write_text(f'[data]\ncifar10 = "{CIFAR10_ZIP}"\n\n[[runs]]\ndataset = "cifar10"\nmethod = "er"\n'
                    f'mem_size = 50\nseed = 2\ntrain_per_class = 100\ntest_per_class = 20\ncache_dir = "{cache_dir}"\n')
    target = tmp_path / "out" / "cifar10" / "er-n100-m50-seed2.json"
    args = build_parser().parse_args(["run", *run_args(cache_dir, "er")])
    data = load_dataset("cifar10", CIFAR10_ZIP, 100, 20, cache_dir)
    run_once(args, data, 2, progress=False, checkpoint=checkpoint_path(target))  # leaves the state after task 4

    lines: list[str] = []
    sweep(grid, tmp_path / "out", jobs=1, dry_run=True, printer=lines.append)
    assert lines[1] == "  cifar10/er-n100-m50-seed2.json (goes on from its checkpoint)"
    written, failed = sweep(grid, tmp_path / "out", jobs=1, threads=1, log_dir=tmp_path / "logs", printer=print)
    assert written == [target] and failed == 0 and not checkpoint_path(target).exists()
    assert json.loads(target.read_text())["resumed_after_pass"] == [4]
