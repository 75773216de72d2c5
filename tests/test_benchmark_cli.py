"""The benchmark client end to end on a tiny slice of the real CIFAR-10 data."""

import json

import pytest
import torch

from clients.bench.benchmark import build_parser, main
from clients.bench.cost.speed import _learner_step
from clients.bench.results import run_label
from clients.bench.stream.resume import run_identity
from learner.methods.registry import PAPER_SETTINGS

from .conftest import CIFAR10_ZIP


def run(tmp_path, cache_dir, method, out, *extra):
    return main(["run", "--dataset", "cifar10", "--data", str(CIFAR10_ZIP), "--method", method,
                 "--train-per-class", "20", "--test-per-class", "10", "--mem-size", "30", "--quiet",
                 "--cache-dir", str(cache_dir), "--out", str(out), *extra])


def test_run_writes_one_result_per_seed_and_table_summarises(tmp_path, cache_dir, capsys):
    assert run(tmp_path, cache_dir, "er", tmp_path / "res" / "er.json", "--seed", "0", "1") == 0
    printed = capsys.readouterr().out
    assert "A_T =" in printed and "after \\ task" in printed and "     -" in printed
    for seed in (0, 1):
        r = json.loads((tmp_path / "res" / f"er-seed{seed}.json").read_text())
        assert r["method"] == "er" and r["dataset"] == "cifar10" and r["mem_size"] == 30 and r["seed"] == seed
        assert len(r["accuracy_matrix"]) == 5 and all(len(row) == 5 for row in r["accuracy_matrix"])
        assert abs(r["average_accuracy"] - sum(r["accuracy_matrix"][-1]) / 5) < 1e-9
        for key in (k for k in r if k.startswith("accuracy_matrix")):  # a task not yet seen is not scored
            assert all((r[key][i][j] is None) == (j > i) for i in range(5) for j in range(5)), key
        assert r["average_forgetting"] is not None and r["steps"] == 20 and r["train_seconds"] > 0
        assert "rehearsal_steps" not in r and "rehearsals" not in r["settings"]  # none unless asked
        assert r["settings"]["train_samples"] == 200 and r["command"].startswith("python -m clients.bench.benchmark")
        share = r["replay_incoming_share"]  # task 1: memory holds only the incoming task's classes
        assert len(share) == 5 and share[0] > 50 and all(0 <= s <= 100 for s in share)

    assert run(tmp_path, cache_dir, "iid-offline", tmp_path / "res" / "iid.json", "--seed", "0") == 0
    r = json.loads((tmp_path / "res" / "iid.json").read_text())
    assert len(r["accuracy_matrix"]) == 1 and r["average_forgetting"] is None
    assert r["steps"] == 5 * 20 and r["mem_size"] is None  # 5 epochs of 200 images in batches of 10

    table = tmp_path / "table.md"
    assert main(["table", str(tmp_path / "res"), "--out", str(table), "--plot", str(tmp_path / "acc.png")]) == 0
    text = table.read_text()
    assert "| cifar10 | 30 | er (20/class) | 2 |" in text and "| cifar10 | - | iid-offline (20/class) | 1 |" in text
    assert (tmp_path / "acc.png").stat().st_size > 1000


def test_rehearsals_take_replay_only_steps_after_each_batch_and_name_the_run(tmp_path, cache_dir, cifar10_slice,
                                                                             capsys):
    idle = tmp_path / "er-rehearsals.json"
    assert run(tmp_path, cache_dir, "er", idle, "--seed", "0", "--rehearsals", "2") == 0
    rehearsed = json.loads(idle.read_text())
    # the memory holds samples from the first batch on: two replay-only steps after each of the 20
    assert rehearsed["steps"] == 20 and rehearsed["rehearsal_steps"] == 40 and rehearsed["settings"]["rehearsals"] == 2
    # a checkpoint of the rehearsing run is another run's to the plain one
    parsed = [build_parser().parse_args(["run", "--dataset", "cifar10", "--data", str(CIFAR10_ZIP),
                                          "--method", "er", *extra]) for extra in ((), ("--rehearsals", "2"))]
    identities = [run_identity(args, cifar10_slice, 0) for args in parsed]
    assert "rehearsals" not in identities[0] and identities[1]["rehearsals"] == 2
    for misuse in (("iid-offline", "--rehearsals", "1"), ("er", "--rehearsals", "1", "--stream-rate", "2x")):
        assert run(tmp_path, cache_dir, misuse[0], tmp_path / "x.json", *misuse[1:]) == 2
        assert "--rehearsals is for in-process streams" in capsys.readouterr().err


def test_a_noisy_stream_scores_the_suspects_against_its_flips_and_pairs_flip_each_class_one_way(tmp_path, cache_dir,
                                                                                                  cifar10_slice):
    """`--label-noise` on the default's learner (ASER's memory, streaming LDA on Lite0's features, 64 px here); the
    pair mode flips each class into the seen class nearest it, so a run's flips are one way a class."""
    from clients.bench.stream.noise import LabelNoise, nearest_classes
    from learner import make_learner
    from learner.networks.backbone import make_backbone

    results = {}
    for mode in ("symmetric", "pair"):
        out = tmp_path / f"{mode}.json"
        assert run(tmp_path, cache_dir, "cb-sv-duel", out, "--seed", "0", "--backbone", "lite0", "--input-size", "64",
                   "--serving-head", "slda", "--lr", "0.01", "--label-noise", "0.3", "--label-noise-mode", mode) == 0
        results[mode] = json.loads(out.read_text())
    for mode, r in results.items():
        noise = r["label_noise"]
        assert noise["mode"] == mode and noise["sent"] == 200 and 30 < noise["flipped"] < 90  # a 30% share of 200
        assert 0 <= noise["precision_at_100"] <= 1 and noise["memory"] == 30 and "final_accuracy_corrected" in noise
        # a deeper review reads further down the same list: more reviewed, more of the flips found
        review = noise["stream_review"]
        assert [stage["share"] for stage in review] == [0.3, 0.4]
        assert noise["stream_suspected"] <= review[0]["reviewed"] <= review[1]["reviewed"] == 80
        assert noise["stream_recall"] <= review[0]["recall"] <= review[1]["recall"] <= 1
    assert "noise 0.3 pair" in run_label(results["pair"]) and "pair" not in run_label(results["symmetric"])
    # under sleep the relabels are new to the top: the idle device sleeps on them before the last measure
    slept = tmp_path / "slept.json"
    assert run(tmp_path, cache_dir, "cb-sv-duel", slept, "--seed", "0", "--backbone", "lite0", "--input-size", "64",
               "--cut", "11", "--serving-head", "slda", "--choose-head", "held-back", "--lr", "0.01", "--train-every",
               "0", "--sleep-every", "100", "--sleep-epochs", "1", "--label-noise", "0.3", "--fresh-sleep-at-end",
               "--fresh-sleep-epochs", "2") == 0
    result = json.loads(slept.read_text())
    fresh = [r for r in result["sleeps"]["each"] if r["fresh"]]  # the stream's end: the top trained again
    assert len(fresh) == 1 and fresh[0]["updates"] == fresh[0]["budget"] > 0 and fresh[0]["budget"] % 2 == 0
    assert result["settings"]["sleep"]["fresh_at_end"] and result["settings"]["sleep"]["fresh_epochs"] == 2
    noise = result["label_noise"]
    assert noise["stream_relabelled"] > 0 and "final_accuracy_corrected_slept" in noise
    # a sample-update for each relabel the store held (one epoch; a held-back sample is not in the store)
    assert 0 < noise["sleep_on_corrections"]["updates"] <= noise["stream_relabelled"] + noise["corrected"]

    learner = make_learner("slda", 10, backbone=make_backbone("lite0", cifar10_slice.image_shape, 64))
    nearest = nearest_classes(learner, cifar10_slice)
    assert sorted(nearest) == list(range(10)) and all(sorted(v + [c]) == list(range(10)) for c, v in nearest.items())
    pairs = LabelNoise(1.0, 0, nearest)
    pairs.begin([0, 1, 2, 3])
    given, _ = pairs.flip(torch.arange(4).repeat(5))
    for c in range(4):  # each class into its nearest seen class, always the same one
        assert set(given[torch.arange(4).repeat(5) == c].tolist()) == {[n for n in nearest[c] if n < 4][0]}


def test_speed_times_the_cases_asked_for_round_by_round(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["speed", "--rounds", "3", "--warmup", "0", "--threads", "1", "--cases",
                 "er,cbrs-ace-aug-it2-ema", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["cases"]) == {"er", "cbrs-ace-aug-it2-ema"} and r["rounds"] == 3 and r["threads"] == 1
    assert all(0 < c["p10_ms"] <= c["median_ms"] and c["mean_ms"] > 0 for c in r["cases"].values())
    ratio = r["cases"]["cbrs-ace-aug-it2-ema"]["median_ms"] / r["cases"]["er"]["median_ms"]
    assert r["ratios"] == {"cbrs-ace-aug-it2-ema / er": round(ratio, 3)}
    assert r["command"].endswith("--cases er,cbrs-ace-aug-it2-ema")
    assert main(["speed", "--rounds", "1", "--cases", "er,warp-drive", "--out", str(out)]) == 2
    assert "unknown cases warp-drive" in capsys.readouterr().err


def test_speed_prices_a_step_on_mini_imagenet_shapes(tmp_path):
    """--dataset: the steps run on that stream's 84x84 images of 100 classes (a learner built for
    CIFAR-10's 32x32 refuses them), and the record says which stream it priced."""
    out = tmp_path / "speed.json"
    assert main(["speed", "--dataset", "mini-imagenet", "--rounds", "1", "--warmup", "0", "--threads", "1",
                 "--cases", "bare-step,er", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dataset"] == "mini-imagenet" and " --dataset mini-imagenet " in r["command"]
    assert set(r["cases"]) == {"bare-step", "er"}
    images = torch.randint(0, 256, (1030, 3, 84, 84), dtype=torch.uint8)
    step = _learner_step("cb-aser", device=torch.device("cpu"), images=images, labels=torch.arange(1030) % 100,
                         autocast_dtype=None, mem_size=1000, dataset="mini-imagenet")
    step()
    learner = step.learner
    assert learner.image_shape == (3, 84, 84) and learner.num_classes == 100 and len(learner.buffer) == 1000
    assert learner.update_policy.k == PAPER_SETTINGS["mini-imagenet"].aser[0] == 7  # CIFAR-10's is 3


def test_missing_data_path_is_a_clear_error(tmp_path, capsys):
    code = main(["run", "--dataset", "cifar10", "--data", str(tmp_path / "nope"), "--method", "er", "--quiet"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_via_streams_through_a_real_service(tmp_path, cache_dir):
    """--via: the stream goes over the WebSocket, evaluation through /predict; the record has
    the in-process form and every sample was trained on once."""
    from .test_service import Server

    server = Server(tmp_path / "svc", method="er", mem_size=30, max_batch_wait_s=0.2).start()
    try:
        out = tmp_path / "via.json"
        # the offline protocol sends the stream at once: a service that bounds its lag would skip
        with pytest.raises(SystemExit, match="ASER_MAX_LAG_S=0"):
            run(tmp_path, cache_dir, "er", out, "--via", server.url, "--loss", "ace")
        server.stop()
        server = Server(tmp_path / "svc", method="er", mem_size=30, max_batch_wait_s=0.2, max_lag_s=0).start()
        # the service trains ER with its default loss, ACE: a run that says otherwise is refused, unsent
        with pytest.raises(SystemExit, match=r"runs method, step, loss \('er', 'joint', 'ace'\)"):
            run(tmp_path, cache_dir, "er", out, "--via", server.url)
        assert run(tmp_path, cache_dir, "er", out, "--via", server.url, "--loss", "ace", "--seed", "3") == 0
        r = json.loads(out.read_text())
        assert r["via"] == server.url and r["method"] == "er" and r["mem_size"] == 30 and r["seed"] == 3
        assert len(r["accuracy_matrix"]) == 5 and all(len(row) == 5 for row in r["accuracy_matrix"])
        assert r["steps"] == 20 and r["settings"]["train_samples"] == 200
        # a task's classes are unknown to the service before they arrive: 0% on them
        assert all(r["accuracy_matrix"][i][j] == 0 for i in range(5) for j in range(i + 1, 5))
        # the service is no longer fresh: a second run is refused
        with pytest.raises(SystemExit, match="fresh service"):
            run(tmp_path, cache_dir, "er", out, "--via", server.url, "--loss", "ace")
    finally:
        server.stop()


def test_via_paces_the_stream_at_wall_clock_rate(tmp_path, cache_dir):
    """--via --stream-rate R: samples go at R per second and tasks are evaluated without waiting
    for the learner; the service's lag bound decides what it skips."""
    import time

    from .test_service import Server

    server = Server(tmp_path / "svc", method="er", mem_size=30, max_lag_s=1, max_batch_wait_s=0.2).start()
    try:
        out = tmp_path / "live.json"
        t0 = time.monotonic()
        assert run(tmp_path, cache_dir, "er", out, "--via", server.url, "--loss", "ace", "--stream-rate", "50") == 0
        assert time.monotonic() - t0 >= 200 / 50 - 0.5  # 200 samples at 50 per second
        rt = json.loads(out.read_text())["realtime"]
        assert rt["stream_rate"] == 50 and rt["trained"] + rt["skipped"] + rt["unseen"] == 200
        assert rt["lean_when_behind"] is True  # the service's setting as resolved (er's default)
        with pytest.raises(SystemExit, match="samples per second"):
            run(tmp_path, cache_dir, "er", tmp_path / "x.json", "--via", server.url, "--loss", "ace",
                "--stream-rate", "2x")
    finally:
        server.stop()


def test_via_scores_a_model_that_has_learned_nothing_as_wrong(tmp_path, cifar10_slice):
    """On a busy machine a fast stream can reach its first evaluation before the service has learned
    any class (it answers 409 no_classes): that model is wrong on every test image, not a crash. A
    service that never trains (its batch never fills) stands for it, deterministically."""
    from clients.api import ServiceClient
    from clients.bench.stream.via_service import evaluate_via

    from .test_service import Server

    server = Server(tmp_path / "svc", method="er", batch_size=100000, max_batch_wait_s=1e6).start()
    try:
        with ServiceClient(server.url) as client:
            assert evaluate_via(client, cifar10_slice, [[0, 1], [2, 3]], chunk=50) == [0.0, 0.0]
    finally:
        server.stop()


def test_young_measures_every_correction_on_one_stream_per_seed(tmp_path, cache_dir):
    out = tmp_path / "young.json"
    assert main(["young", "--data", str(CIFAR10_ZIP), "--seeds", "0-1", "--train-per-class", "20",
                 "--cache-dir", str(cache_dir), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["runs"]) == 2 * 3 * 4 and r["command"].startswith("python -m clients.bench.benchmark young")
    assert "--method cb-sv-duel --augment on --iterations 2" in r["command"]  # the service's default learner
    for row in r["runs"]:
        assert row["seen"] == 2 * row["task"] and sum(row["answers"].values()) == 40 * row["seen"]
        assert row["answered"] == sum(n > 0 for n in row["answers"].values()) and 0 <= row["accuracy"] <= 100
    none = [s for s in r["summary"] if s["correction"] == "none"]
    assert len(none) == 3 and all(s["minus_none"] == 0 and s["seeds"] == 2 for s in none)
    bias = {(s["task"], s["correction"]): s for s in r["summary"]}
    for task in (1, 2, 3):  # the summary is the runs' own means, paired
        rows = [x["accuracy"] for x in r["runs"] if x["task"] == task and x["correction"] == "bias"]
        base = [x["accuracy"] for x in r["runs"] if x["task"] == task and x["correction"] == "none"]
        assert bias[(task, "bias")]["minus_none"] == pytest.approx((sum(rows) - sum(base)) / 2, abs=0.01)
