"""The resumable sweep and the paired comparison, on tiny slices of the real CIFAR-10 data: each
run is a real `clients.bench.benchmark run` subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clients.bench.benchmark import main
from clients.bench.results import comparisons, paired_difference
from clients.bench.stream.sweep import Lock, RunSpec, expand, read_grid, run_one, sweep
from clients.bench.stream.tables import comparison_table, load_paper, summary_table

from .conftest import CIFAR10_ZIP

PAPER_TABLE = Path(__file__).parents[1] / "results" / "paper-table1.toml"

GRID = """
[data]
cifar10 = "{data}"

[[runs]]
dataset = "cifar10"
method = "er"
step = ["joint", "separate"]
mem_size = 30
seed = "0-1"
train_per_class = 20
test_per_class = 10
cache_dir = "{cache}"
"""


def write_grid(tmp_path, cache_dir):
    grid = tmp_path / "grid.toml"
    grid.write_text(GRID.format(data=CIFAR10_ZIP, cache=cache_dir))
    return grid


def test_sweep_runs_what_is_missing_and_resumes(tmp_path, cache_dir):
    grid, out = write_grid(tmp_path, cache_dir), tmp_path / "results"
    # an interrupted earlier sweep left one result; it is kept, not run again
    (out / "cifar10").mkdir(parents=True)
    lines: list[str] = []
    first = expand(read_grid(grid))[0]
    assert run_one(first, str(CIFAR10_ZIP), out / "cifar10" / first.file_name(), 1, "cpu", tmp_path / "logs")
    before = (out / "cifar10" / "er-n20-m30-seed0.json").stat().st_mtime_ns

    written, failed = sweep(grid, out, jobs=2, threads=2, log_dir=tmp_path / "logs", printer=lines.append)
    assert failed == 0 and lines[0].startswith("3 runs to do") and "(1 already there)" in lines[0]
    names = sorted(p.name for p in written)
    assert names == ["er-n20-m30-seed1.json", "er-separate-n20-m30-seed0.json", "er-separate-n20-m30-seed1.json"]
    assert (out / "cifar10" / "er-n20-m30-seed0.json").stat().st_mtime_ns == before
    assert sum("A_T" in line for line in lines) == 3  # a progress line per finished run
    for name in names:
        r = json.loads((out / "cifar10" / name).read_text())
        assert r["settings"]["step"] == ("separate" if "separate" in name else "joint")
        assert r["settings"]["threads"] == 1 and r["mem_size"] == 30 and r["average_accuracy_ncm"] is not None
    assert not list(out.rglob("*.lock")) and not list(out.rglob("*.partial")) and not list(out.rglob("*.resume.pt"))
    log = (tmp_path / "logs" / "cifar10" / "er-n20-m30-seed1.log").read_text()  # a line per task shows a run in progress
    assert "er seed 1: pass 1/5, accuracy on the observed tasks" in log and "pass 5/5" in log

    lines.clear()
    assert sweep(grid, out, jobs=2, log_dir=tmp_path / "logs", printer=lines.append) == ([], 0)
    assert lines == ["0 runs to do in " + str(out) + " (4 already there)"]

    # the paired comparison of the two steps over the two seeds, the per-seed plot, the paper's column
    table = tmp_path / "table.md"
    assert main(["table", str(out), "--out", str(table), "--compare", "er (20/class)", "er (separate, 20/class)",
                 "--seeds-plot", f"cifar10:30:{tmp_path / 'seeds.png'}", "--paper", str(PAPER_TABLE)]) == 0
    text = table.read_text()
    assert "| cifar10 | 30 | er (separate, 20/class) | 2 |" in text and "| paper's A_T (%) |" in text
    assert "| cifar10 | 30 | er (20/class) | er (separate, 20/class) | 2 |" in text
    assert (tmp_path / "seeds.png").stat().st_size > 1000


def test_a_running_sweep_follows_edits_to_its_grid(tmp_path, cache_dir):
    """A block added at the top while the sweep runs goes next; a grid broken by an edit is
    reported and the sweep goes on with the grid as last read."""
    grid, out = tmp_path / "grid.toml", tmp_path / "results"
    first = GRID.format(data=CIFAR10_ZIP, cache=cache_dir).replace('step = ["joint", "separate"]', "")
    grid.write_text(first)
    lines: list[str] = []

    def edit_after_each_run(line: str) -> None:
        lines.append(line)
        finished = sum("A_T" in x for x in lines)
        if "A_T" in line and finished == 1:  # separate-step ER on seed 0, ahead of the rest
            grid.write_text(first.replace("[[runs]]", '[[runs]]\ndataset = "cifar10"\nmethod = "er"\nstep = "separate"\n'
                                          'mem_size = 30\nseed = 0\ntrain_per_class = 20\ntest_per_class = 10\n'
                                          f'cache_dir = "{cache_dir}"\n\n[[runs]]', 1))
        elif "A_T" in line and finished == 2:
            grid.write_text("[[runs]\nbroken")

    written, failed = sweep(grid, out, jobs=1, threads=1, log_dir=tmp_path / "logs", printer=edit_after_each_run)
    assert failed == 0
    assert [p.name for p in written] == ["er-n20-m30-seed0.json", "er-separate-n20-m30-seed0.json",
                                         "er-n20-m30-seed1.json"]
    assert any("unreadable" in line for line in lines)
    assert [line.split("]")[0] for line in lines if "A_T" in line] == ["[1 done, 1 to go", "[2 done, 1 to go",
                                                                       "[3 done, 0 to go"]


def test_a_grid_naming_a_method_this_code_lacks_is_refused(tmp_path):
    """A method added to the learner after a sweep started is unknown to that sweep: it would name
    the run's file and build its command without the method's memory; the grid is refused instead
    (a running sweep goes on with the grid as last read)."""
    grid = tmp_path / "grid.toml"
    grid.write_text(f'[data]\ncifar10 = "{CIFAR10_ZIP}"\n\n[[runs]]\ndataset = "cifar10"\nmethod = ["er", "er-next"]\nseed = 0\n')
    with pytest.raises(ValueError, match="er-next"):
        read_grid(grid)


def test_a_sweep_whose_code_changed_starts_no_more_runs(tmp_path, cache_dir, monkeypatch):
    """A running sweep names runs by the code it started with: once its file changes (an option added to the
    names), it would take a new run for one already done; it starts nothing more and says to restart it."""
    import clients.bench.stream.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "STARTED_AS", "an older file")
    lines: list[str] = []
    assert sweep(write_grid(tmp_path, cache_dir), tmp_path / "out", jobs=1, log_dir=tmp_path / "logs",
                 printer=lines.append) == ([], 0)
    assert "changed since this sweep started" in lines[-1] and not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert not sweep_module.code_changed()


def test_a_held_lock_is_respected_and_a_dead_ones_taken_over(tmp_path, cache_dir):
    spec = RunSpec("cifar10", "er", 30, "joint", "ce", "fp32", 5,
                   extra=(("cache_dir", str(cache_dir)), ("test_per_class", 10), ("train_per_class", 20)))
    target = tmp_path / spec.file_name()
    held = Lock(target)
    assert held.acquire() and not Lock(target).acquire()  # this process holds it
    assert run_one(spec, str(CIFAR10_ZIP), target, 1, "cpu", tmp_path / "logs") is None
    assert not target.exists() and held.path.exists()
    held.release()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    held.path.write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "started": 0}))
    result = run_one(spec, str(CIFAR10_ZIP), target, 1, "cpu", tmp_path / "logs")
    assert result["seed"] == 5 and target.exists() and not held.path.exists()


def test_a_failed_run_is_reported_and_leaves_nothing(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(f'[data]\ncifar10 = "{tmp_path / "missing.zip"}"\n\n'
                    '[[runs]]\ndataset = "cifar10"\nmethod = "er"\nseed = 0\n')
    lines: list[str] = []
    assert sweep(grid, tmp_path / "out", jobs=1, log_dir=tmp_path / "logs", printer=lines.append) == ([], 1)
    assert "FAILED" in lines[-1] and "does not exist" in (tmp_path / "logs" / "cifar10" / "er-m1000-seed0.log").read_text()
    assert not list((tmp_path / "out").rglob("*.*"))


def test_paired_difference_is_a_paired_t_interval():
    # differences 1, 2, 3: mean 2, sd 1, t(0.975, 2 df) = 4.303 -> half-width 4.303 / sqrt 3
    d = paired_difference({0: 50.0, 1: 40.0, 2: 45.0}, {0: 51.0, 1: 42.0, 2: 48.0})
    assert d["seeds"] == 3 and d["mean"] == 2.0 and abs(d["ci95"] - 4.3027 / 3 ** 0.5) < 1e-3
    assert (d["wins_a"], d["wins_b"]) == (0, 3)


def test_the_comparison_table_says_over_how_many_seeds_ncm_was_paired():
    def run(seed, acc, ncm=None, seconds=100.0):
        return {"seed": seed, "average_accuracy": acc, "train_seconds": seconds,
                **({"average_accuracy_ncm": ncm} if ncm is not None else {})}

    groups = {("cifar10", 1000, "er"): [run(0, 40.0), run(1, 41.0, 50.0), run(2, 42.0, 51.0), run(3, 0.0)],
              ("cifar10", 1000, "aser-mu"): [run(0, 41.0, seconds=400.0), run(1, 43.0, 49.0),
                                             run(2, 42.5, 50.0, seconds=400.0)]}
    (row,) = comparisons(groups, [("er", "aser-mu")])
    line = comparison_table([row]).splitlines()[2]
    assert row["accuracy"]["seeds"] == 3 and row["ncm"]["seeds"] == 2
    # train time over the paired seeds only: (400 + 100 + 400) / 300
    assert line.endswith("-1.00 ± 0.00 (n=2) | 3.00x |") and "| 3 |" in line


def test_the_summary_shows_how_well_new_classes_are_learned_and_replayed():
    def run(seed, diagonal, share=None):
        matrix = [[diagonal[i] if j == i else 10.0 for j in range(3)] for i in range(3)]
        return {"seed": seed, "average_accuracy": 30.0, "accuracy_matrix": matrix, "train_seconds": 1.0,
                **({"replay_incoming_share": share} if share else {})}

    groups = {("cifar10", 1000, "er"): [run(0, [90.0, 60.0, 40.0], [100.0, 30.0, 20.0]),
                                        run(1, [90.0, 70.0, 50.0])]}
    line = summary_table(groups).splitlines()[2]
    # new-task accuracy: tasks 2 and 3 only (50 and 60); replay share: tasks 2 and 3 of the one run with it
    assert "| 55.0 ± 63.5 | 25.0 (n=1) |" in line


def test_the_summary_puts_the_papers_number_beside_ours_where_it_applies():
    def run(seed, acc):
        return {"seed": seed, "average_accuracy": acc, "accuracy_matrix": [[acc]], "train_seconds": 1.0}

    groups = {("cifar10", 1000, "er"): [run(0, 40.0), run(1, 42.0)], ("cifar10", 1000, "er (ace)"): [run(0, 50.0)],
              ("cifar10", 200, "aser-mu (separate)"): [run(0, 30.0)], ("cifar10", 0, "iid-offline"): [run(0, 80.0)]}
    lines = summary_table(groups, load_paper(PAPER_TABLE)).splitlines()
    assert lines[0].startswith("| dataset | M | configuration | seeds | A_T (%) | paper's A_T (%) | F_T (%) |")
    rows = {line.split(" | ")[2]: line.split(" | ")[4:6] for line in lines[2:6]}
    assert rows == {"iid-offline": ["80.0", "79.7 ± 0.4"], "aser-mu (separate)": ["30.0", "26.4 ± 1.5"],
                    "er": ["41.0 ± 12.7", "38.4 ± 1.7"], "er (ace)": ["50.0", "-"]}
