"""A resumable sweep of benchmark runs: `python -m clients.bench.benchmark sweep GRID --jobs N --out DIR`.

GRID (TOML, or YAML) holds the datasets' paths and blocks of runs; in a block every key is a
value or a list, and the block stands for every combination:

    [data]
    cifar10 = "../shared/datasets/cifar10-jpeg.zip"

    [[runs]]                      # tier 1
    dataset = "cifar10"
    method = ["er", "aser-mu"]
    mem_size = 1000
    step = "joint"                # joint | separate
    loss = "ce"                   # ce | ace
    precision = "fp32"            # fp32 | bf16-latent | bf16 | bf16-compile
    augment = false               # the stronger learner's options (`run --augment --iterations --ema`)
    iterations = 1
    ema = 0                       # 0: no moving average
    train_per_class = 0           # 0: the whole stream
    seed = "0-14"                 # a list, or a range "a-b"

Other keys of a block (lr, ...) are passed to `run` as they are (true: a flag alone) and do not enter
the file names, except the real-time protocol's (stream_rate, max_lag, catch_up_memory_share, lean_when_behind,
idle_rehearsal), feature_max_age (the class-balanced KNN-SV memories' staleness bound), the pretrained backbone's and
its heads' settings, and rehearsals.
Each run writes DIR/<dataset>/<method>[-<precision>][-<step>][-<loss>][-aug][-it<N>][-ema<D>][-n<N>][-m<M>]-seed<s>.json
(defaults left out, so earlier result files count). A combination whose file exists is skipped,
so a sweep resumes where it stopped, across sessions. N runs go at once, each in its own process
with the threads split between them, blocks in order and seeds interleaved (so paired
configurations fill up together). The grid is read again before each run starts, so a running
sweep follows edits to it (blocks reordered or added) from its next run on. A run holds
`<file>.lock` while it works and writes its result under a temporary name, renamed when
complete: two sweeps never write the same file, and a lock left by a process that died is taken
over. A run saves its state after each task in `<file stem>.resume.pt` beside its result and goes
on from there when it is started again (`run --checkpoint`): a sweep cut off loses at most one
task of each run in flight.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from learner.methods.registry import METHODS, REPLAY_METHODS
from learner.networks.lite0 import POOLED

AXES = ("dataset", "method", "mem_size", "step", "loss", "precision", "seed", "augment", "iterations", "ema",
        "train_per_class")
DEFAULTS = {"mem_size": 1000, "step": "joint", "loss": "ce", "precision": "fp32", "augment": False, "iterations": 1,
            "ema": 0, "train_per_class": 0}
# a sweep names runs by the code it started with: an option added since would name a run as one already done
SOURCE = Path(__file__)
STARTED_AS = hashlib.blake2b(SOURCE.read_bytes(), digest_size=8).hexdigest()
PRECISION_FLAGS = {"fp32": [], "bf16-latent": ["--bf16-latent"], "bf16": ["--bf16"], "bf16-compile": ["--bf16", "--compile"]}


@dataclass(frozen=True)
class RunSpec:
    dataset: str
    method: str
    mem_size: int
    step: str
    loss: str
    precision: str
    seed: int
    augment: bool | str = False  # True: crop + flip; "strong": `learner.methods.augment.StrongAugment`
    iterations: int = 1
    ema: float = 0
    train_per_class: int = 0  # a reduced stream: its results never stand for full-length ones
    extra: tuple = field(default=())  # (key, value) pairs passed through to `run`

    @property
    def uses_memory(self) -> bool:
        return self.method in REPLAY_METHODS or self.method == "agem"

    def file_name(self) -> str:
        """
        >>> RunSpec("cifar10", "er", 1000, "separate", "ace", "fp32", 3).file_name()
        'er-separate-ace-m1000-seed3.json'
        >>> RunSpec("cifar10", "aser-mu", 1000, "joint", "ce", "bf16-latent", 0).file_name()
        'aser-mu-bf16latent-m1000-seed0.json'
        >>> RunSpec("cifar10", "iid-offline", 1000, "joint", "ce", "fp32", 0).file_name()
        'iid-offline-seed0.json'
        >>> RunSpec("cifar10", "er", 200, "joint", "ace", "fp32", 1, True, 3, 0.99, 1000).file_name()
        'er-ace-aug-it3-ema0.99-n1000-m200-seed1.json'
        >>> RunSpec("cifar10", "er", 1000, "joint", "ace", "fp32", 0, "strong", 2, 0.99,
        ...         extra=(("distill", 1.0), ("replay_batch", 20))).file_name()
        'er-ace-augstrong-it2-ema0.99-kd1-rb20-m1000-seed0.json'
        >>> RunSpec("cifar10", "er", 1000, "joint", "ace", "fp32", 0,
        ...         extra=(("idle_rehearsal", True), ("max_lag", 60), ("stream_rate", "2x"))).file_name()
        'er-ace-rate2x-lag60-idle-m1000-seed0.json'
        >>> RunSpec("cifar10", "er", 1000, "joint", "ace", "fp32", 0, True, 2, 0.99,
        ...         extra=(("lean_when_behind", True), ("max_lag", 10), ("stream_rate", "4x"))).file_name()
        'er-ace-aug-it2-ema0.99-rate4x-lag10-lean-m1000-seed0.json'
        >>> RunSpec("cifar10", "cb-sv-duel", 200, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 15), ("serving_head", "slda"), ("lr", 0.01))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut15-serveslda-lr0.01-m200-seed0.json'
        >>> RunSpec("cifar10", "cb-sv-duel", 1000, "joint", "ace", "fp32", 1, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("serving_head", "slda"), ("trained_head_from", 1000))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-serveslda-from1000-m1000-seed1.json'
        >>> RunSpec("eurosat", "cb-sv-duel", 1000, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("serving_head", "slda"), ("choose_head", True))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-serveslda-chosen-m1000-seed0.json'
        >>> RunSpec("eurosat", "cb-sv-duel", 1000, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("serving_head", "slda"), ("choose_head", True), ("train_every", 5))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-serveslda-chosen-every5-m1000-seed0.json'
        >>> RunSpec("eurosat", "cb-sv-duel", 1000, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("serving_head", "slda"), ("optimizer", "adam"), ("lr", 0.001))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-serveslda-adam-lr0.001-m1000-seed0.json'
        >>> RunSpec("eurosat", "cb-sv-duel", 1000, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("serving_head", "slda"), ("rehearsals", 3))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-serveslda-m1000-rehearsals3-seed0.json'
        >>> RunSpec("eurosat", "cb-sv-duel", 1000, "joint", "ace", "fp32", 0, extra=(("backbone", "lite0"),
        ...         ("cut", 11), ("train_every", 0), ("sleep_every", 2000), ("sleep_draw", "new-half"))).file_name()
        'cb-sv-duel-ace-lite0-128px-cut11-every0-m1000-sleep2000x8-new-half-seed0.json'
        """
        parts = [self.method]
        if self.precision != "fp32":
            parts.append(self.precision.replace("-", ""))
        parts += [v for v, default in ((self.step, "joint"), (self.loss, "ce")) if v != default]
        parts += [{True: "aug", False: ""}.get(self.augment, f"aug{self.augment}")] * bool(self.augment)
        parts += [f"it{self.iterations}"] * (self.iterations != 1)
        parts += [f"ema{self.ema:g}"] * bool(self.ema) + [f"n{self.train_per_class}"] * bool(self.train_per_class)
        extra = dict(self.extra)  # the real-time protocol's settings name their runs too
        if "stream_rate" in extra:
            parts.append(f"rate{extra['stream_rate']}")
        if extra.get("max_lag"):
            parts.append(f"lag{extra['max_lag']:g}")
        if "catch_up_memory_share" in extra:
            parts.append(f"share{extra['catch_up_memory_share']:g}")
        if extra.get("lean_when_behind"):
            parts.append("lean")
        if extra.get("idle_rehearsal"):
            parts.append("idle")
        if "feature_max_age" in extra:
            parts.append(f"age{extra['feature_max_age']}")
        if extra.get("distill"):
            parts.append(f"kd{extra['distill']:g}")
        if extra.get("replay_batch", 10) != 10:
            parts.append(f"rb{extra['replay_batch']}")
        if extra.get("serving_bias"):
            parts.append("bias")
        if extra.get("backbone", "scratch") != "scratch":  # the pretrained backbone's settings
            parts.append(f"{extra['backbone']}-{extra.get('input_size', 128)}px-cut{extra.get('cut', POOLED)}")
            if extra.get("latent_bits", 16) != 16:
                parts.append(f"{extra['latent_bits']}bit")
            if extra.get("standardize_features"):
                parts.append("std")
        if "serving_head" in extra:
            parts.append(f"serve{extra['serving_head']}")
        if "trained_head_from" in extra:
            parts.append(f"from{extra['trained_head_from']}")
        if extra.get("choose_head"):  # True: measured on the stream; "held-back": on held-back samples
            parts.append("chosen" if extra["choose_head"] is True else f"chosen{extra['choose_head'].replace('-', '')}")
        if extra.get("head_prior"):
            parts.append(f"prior{extra['head_prior']}")
        if extra.get("calibrate"):
            parts.append("cal")
        if extra.get("label_noise"):
            parts.append(f"noise{extra['label_noise']}")
        if extra.get("label_noise_mode", "symmetric") != "symmetric":
            parts.append(extra["label_noise_mode"])
        if extra.get("suspect_rule"):
            parts.append("suspects")
        if extra.get("train_every", 1) != 1:
            parts.append(f"every{extra['train_every']}")
        if extra.get("optimizer", "sgd") != "sgd":
            parts.append(extra["optimizer"])
        if "lr" in extra:
            parts.append(f"lr{extra['lr']:g}")
        if self.uses_memory:
            parts.append(f"m{self.mem_size}")
        if extra.get("rehearsals"):
            parts.append(f"rehearsals{extra['rehearsals']}")
        if extra.get("sleep_every"):  # the sleep schedule, its budget, and what differs from its defaults
            parts.append(f"sleep{extra['sleep_every']}x{extra.get('sleep_epochs', 8):g}")
            parts += [f"{extra[k]}" for k, d in (("sleep_source", "store"), ("sleep_draw", "balanced"),
                                                 ("sleep_schedule", "constant"))
                      if extra.get(k, d) != d]
            if extra.get("sleep_lr", 0.01) != 0.01:
                parts.append(f"slr{extra['sleep_lr']:g}")
            if extra.get("sleep_batch", 32) != 32:
                parts.append(f"sb{extra['sleep_batch']}")
            if extra.get("fresh_sleep_at_end"):
                parts.append(f"fresh{extra['fresh_sleep_epochs']:g}" if extra.get("fresh_sleep_epochs") else "fresh")
        return "-".join(parts) + f"-seed{self.seed}.json"

    def command(self, data: str, out: Path, threads: int, device: str, checkpoint: Path) -> list[str]:
        cmd = [sys.executable, "-m", "clients.bench.benchmark", "run", "--dataset", self.dataset, "--data", data,
               "--method", self.method, "--mem-size", str(self.mem_size), "--seed", str(self.seed),
               "--threads", str(threads), "--device", device, "--quiet", "--out", str(out),
               "--checkpoint", str(checkpoint), *PRECISION_FLAGS[self.precision]]
        if self.method in REPLAY_METHODS:
            cmd += ["--step", self.step, "--loss", self.loss, "--iterations", str(self.iterations)]
            cmd += ["--augment"] * bool(self.augment) + [self.augment] * isinstance(self.augment, str)
        cmd += ["--ema", str(self.ema)] * bool(self.ema)
        cmd += ["--train-per-class", str(self.train_per_class)] * bool(self.train_per_class)
        for key, value in self.extra:
            flag = f"--{key.replace('_', '-')}"
            cmd += [flag] if value is True else [] if value is False else [flag, str(value)]
        return cmd


def read_grid(path: Path) -> dict:
    """The grid in `path`; ValueError if a block lacks an axis, a dataset lacks its [data] path or a
    method is unknown."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        grid = yaml.safe_load(text)
    else:
        grid = tomllib.loads(text)
    specs = expand(grid)
    unknown = {s.dataset for s in specs} - set(grid.get("data", {}))
    if unknown:
        raise ValueError(f"no [data] path for {sorted(unknown)}")
    # a running sweep knows the methods of the code it started with: it would name and build a newer one wrongly
    new_methods = {s.method for s in specs} - set(METHODS)
    if new_methods:
        raise ValueError(f"methods unknown to this sweep's code: {sorted(new_methods)} (restart it after adding one)")
    return grid


def seeds(value) -> list[int]:
    if isinstance(value, str) and "-" in value:
        first, last = value.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def expand(grid: dict) -> list[RunSpec]:
    """Every combination of every block (a list under any key, an axis or not, is one more
    dimension), blocks in order, seeds interleaved within a block."""
    specs: list[RunSpec] = []
    for block in grid.get("runs", []):
        axes = {k: block.get(k, DEFAULTS.get(k)) for k in AXES}
        if axes["dataset"] is None or axes["method"] is None or axes["seed"] is None:
            raise ValueError(f"a block needs dataset, method and seed: {block}")
        values = [seeds(axes["seed"]) if k == "seed" else (v if isinstance(v, list) else [v]) for k, v in axes.items()]
        extras = {k: (v if isinstance(v, list) else [v]) for k, v in sorted(block.items()) if k not in AXES}
        combos = [RunSpec(*combo, extra=tuple(zip(extras, extra)))
                  for combo in itertools.product(*values) for extra in itertools.product(*extras.values())]
        specs += sorted(combos, key=lambda s: s.seed)  # stable: the other axes keep their order per seed
    return list(dict.fromkeys(specs))


class Lock:
    """`<file>.lock`, created exclusively; a lock whose process is gone is taken over."""

    def __init__(self, target: Path):
        self.path = target.with_name(target.name + ".lock")

    def acquire(self) -> bool:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if not self._stale():
                    return False
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
            return True
        return False

    def _stale(self) -> bool:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return True  # half-written by a process that died while creating it
        if owner.get("host") != socket.gethostname():
            return True  # another machine's session, which has ended
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def run_one(spec: RunSpec, data: str, target: Path, threads: int, device: str, log_dir: Path) -> dict | None:
    """Run one combination unless its file exists or another process holds it; the result, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = Lock(target)
    if target.exists() or not lock.acquire():
        return None
    partial = target.with_name(target.name + ".partial")
    try:
        if target.exists():  # finished by another sweep between the check and the lock
            return None
        log_path = log_dir / spec.dataset / (target.stem + ".log")  # one name may exist for several datasets
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            code = subprocess.run(spec.command(data, partial, threads, device, checkpoint_path(target)),
                                  stdout=log, stderr=subprocess.STDOUT,
                                  cwd=Path(__file__).resolve().parents[3]).returncode
        if code != 0 or not partial.exists():
            raise RuntimeError(f"{target.name}: the run failed (exit {code}); see {log_path}")
        os.replace(partial, target)
        return json.loads(target.read_text())
    finally:
        partial.unlink(missing_ok=True)
        lock.release()


def sweep(grid_path: Path, out: Path, jobs: int, threads: int | None = None, device: str = "auto",
          log_dir: Path = Path(".cache/sweep-logs"), dry_run: bool = False, printer=print) -> tuple[list[Path], int]:
    """Run what is missing, reading the grid again before each run (and starting none once this module's
    file has changed); returns the result files written by this call and the count of failed runs."""
    grid = read_grid(grid_path)
    todo = missing(grid, out)
    printer(f"{len(todo)} runs to do in {out} ({len(expand(grid)) - len(todo)} already there)")
    if dry_run:
        for s in todo:
            resumes = checkpoint_path(out / s.dataset / s.file_name()).exists()
            printer(f"  {s.dataset}/{s.file_name()}{' (goes on from its checkpoint)' if resumes else ''}")
        return [], 0
    per_job = max(1, (threads or os.cpu_count() or 1) // jobs)
    written: list[Path] = []
    failed, finished = 0, 0
    tried: set[RunSpec] = set()  # started by this call: a failed run is not retried in a loop
    running: dict[Future, RunSpec] = {}
    stopping = False  # this module's file changed: no more runs start
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while True:
            while len(running) < jobs and not stopping:
                if stopping := code_changed():
                    printer(f"{SOURCE} changed since this sweep started: it starts no more runs (restart it)")
                    break
                grid = reread(grid_path, grid, printer)
                spec = next((s for s in missing(grid, out) if s not in tried), None)
                if spec is None:
                    break
                tried.add(spec)
                running[pool.submit(run_one, spec, grid["data"][spec.dataset], out / spec.dataset / spec.file_name(),
                                    per_job, device, log_dir)] = spec
            if not running:
                return written, failed
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                spec, finished = running.pop(future), finished + 1
                target = out / spec.dataset / spec.file_name()
                to_go = len(running) + sum(s not in tried for s in missing(grid, out))
                outcome = _report(future, spec, target, f"[{finished} done, {to_go} to go]", printer)
                written += [target] if outcome else []
                failed += outcome is False


def _report(future: Future, spec: RunSpec, target: Path, progress: str, printer) -> bool | None:
    """Print a finished run's line: True if it wrote its file, None if skipped, False if it failed."""
    try:
        result = future.result()
    except Exception as exc:  # one failed run does not stop the sweep
        printer(f"{progress} FAILED {exc}")
        return False
    if result is None:
        printer(f"{progress} skipped {target} (done or held by another sweep)")
        return None
    printer(f"{progress} {spec.dataset} {target.stem}: A_T {result['average_accuracy']:.2f}"
            f"{_ncm(result)}, {result['train_seconds']:.0f} s training -> {target}")
    return True


def checkpoint_path(target: Path) -> Path:
    """Where the run of `target` keeps its state between tasks (`run --checkpoint`): beside its
    result, so that a run cut off in one session goes on from its last task in the next."""
    return target.with_name(target.stem + ".resume.pt")


def missing(grid: dict, out: Path) -> list[RunSpec]:
    """The grid's combinations whose result file is not in `out`, in the order they run."""
    return [s for s in expand(grid) if not (out / s.dataset / s.file_name()).exists()]


def code_changed() -> bool:
    """Whether this module's file differs from the code this process runs."""
    try:
        return hashlib.blake2b(SOURCE.read_bytes(), digest_size=8).hexdigest() != STARTED_AS
    except OSError:
        return False


def reread(grid_path: Path, grid: dict, printer) -> dict:
    """The grid as the file now says, or `grid` unchanged if an edit left it unreadable."""
    try:
        return read_grid(grid_path)
    except Exception as exc:  # whatever the edit broke (TOML, YAML, a block), hours of runs go on
        printer(f"{grid_path} unreadable ({exc}); going on with the grid as last read")
        return grid


def _ncm(result: dict) -> str:
    return f" (NCM {result['average_accuracy_ncm']:.2f})" if result.get("average_accuracy_ncm") is not None else ""


def cmd_sweep(args) -> int:
    _, failed = sweep(Path(args.grid), Path(args.out), args.jobs, args.threads, args.device, Path(args.log_dir),
                      args.dry_run, printer=lambda line: print(line, flush=True))
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run every combination of a grid whose result file is missing (resumable)")
    p.add_argument("grid", help="a TOML or YAML grid (see clients/bench/stream/sweep.py)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--out", default="results", help="result folder (files go to OUT/<dataset>/)")
    p.add_argument("--threads", type=int, help="threads in all, split between the jobs (default: all cores)")
    p.add_argument("--device", default="auto")
    p.add_argument("--log-dir", default=".cache/sweep-logs", help="each run's output, in LOG_DIR/<dataset>/")
    p.add_argument("--dry-run", action="store_true", help="list what would run")
    p.set_defaults(func=cmd_sweep)
