"""Lite0's frozen part in onnxruntime: what every incoming image and every prediction pays, at the
runtime's speed.

The frozen part never trains, so it needs no autograd: it is traced into an ONNX graph once a machine (in a
child process, the graph kept in a file cache: `graph_cache_dir`) and onnxruntime runs it, about 3.5x faster than
PyTorch's eager forward on one CPU thread (5.1 against 18.3 CPU ms an image at 160 px:
results/speed/service-cost-after.json, `parts`). The graphs take the pixels as `resize_pixels` gives them (floats
scaled as Lite0 was trained, at the input size), so an image of any size is resized as before; PyTorch still runs
what trains and anything on a GPU.

`lower` gives the latent at the cut and, below the pooled cut, the frozen network's pooled
features of that latent as the memory stores it in 16 bits (one pass for both: what the streaming
heads read); `upper` gives those features from stored latents. A top that trains only in sleeps keeps its weights
from one sleep to the next: `TopGraph` runs a copy of it the same way while they hold.

>>> import torch
>>> from learner.networks.lite0 import load_lite0
>>> frozen = load_lite0(input_size=96)
>>> graphs = FrozenGraphs(frozen, cut=12)
>>> pixels = torch.randint(0, 256, (2, 3, 96, 96), dtype=torch.uint8)
>>> latent, features = graphs.lower(pixels)
>>> latent.shape, features.shape
(torch.Size([2, 192, 3, 3]), torch.Size([2, 1280]))
>>> bool((latent - frozen.lower(pixels, 12)).abs().max() < 1e-3)
True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .lite0 import POOLED, Lite0, resize_pixels

log = logging.getLogger("aser.learner")

RUN_BATCH = 10  # images a run (the stream's batch): the lower part's arena keeps the largest run's buffers (about 60
# MB at 10 images of 160 px, 200 at 32), at no cost in speed


class _Lower(nn.Module):
    """Scaled pixels -> the latent at `cut` (and, below the pooled cut, the pooled features of the
    latent rounded to fp16, as `learner.networks.backbone.LatentPixelFeatures` computes them)."""

    def __init__(self, frozen: Lite0, cut: int, with_features: bool):
        super().__init__()
        self.frozen, self.cut, self.with_features = frozen, cut, with_features

    def forward(self, x: torch.Tensor):
        x = self.frozen.stem(x)
        for block in self.frozen.blocks[:self.cut]:
            x = block(x)
        if self.cut == POOLED:
            return self.frozen.head(x).mean((2, 3))
        if not self.with_features:
            return x
        return x, self.frozen.upper(x.half().float(), self.cut)


class _Upper(nn.Module):
    def __init__(self, frozen: Lite0, cut: int):
        super().__init__()
        self.frozen, self.cut = frozen, cut

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.frozen.upper(latent, self.cut)


def onnx_graph(module: nn.Module, example: torch.Tensor, outputs: int) -> bytes:
    """`module` traced to ONNX: input "x", outputs "out0".... The TorchScript tracer: the frozen part has no
    control flow, and it exports in under a second where torch.export takes six (it would need a file
    cache, and the service starts it often)."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    module.eval()  # the exporter restores the mode it found: train mode would reach the shared frozen modules
    buffer = io.BytesIO()
    names = [f"out{i}" for i in range(outputs)]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), buffer, dynamo=False, input_names=["x"], output_names=names,
                          dynamic_axes={"x": {0: "n"}, **{name: {0: "n"} for name in names}}, opset_version=17)
    return buffer.getvalue()


# The exporter's imports (torch.onnx, protobuf, onnx) and the trace's garbage stay in a process: 40 MB at 160 px, kept
# (docs/results/sleep.md). A child process exports instead, for about 3 CPU s more (its own imports).
_EXPORT_IN_CHILD = """
import sys, torch
torch.set_num_threads(1)
from learner.networks.frozen_runtime import onnx_graph
module, example, outputs = torch.load(sys.argv[1], weights_only=False)
with open(sys.argv[2], "wb") as f:
    f.write(onnx_graph(module, example, outputs))
"""


def onnx_graph_apart(module: nn.Module, example: torch.Tensor, outputs: int) -> bytes:
    """`onnx_graph` in a child Python process, which this one waits for: the same bytes, none of the exporter's
    memory here. Its CPU is the child's (`cpu_seconds` counts it once the child has ended)."""
    with tempfile.TemporaryDirectory(prefix="aser-export-") as directory:
        job, graph = Path(directory) / "job.pt", Path(directory) / "graph.onnx"
        torch.save((module, example, outputs), job)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run([sys.executable, "-c", _EXPORT_IN_CHILD, str(job), str(graph)], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"the ONNX export failed: {done.stderr.decode(errors='replace')[-2000:]}")
        return graph.read_bytes()


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the graph exports)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def graph_cache_dir() -> Path:
    """Where the frozen part's graphs are kept between processes: $XDG_CACHE_HOME (or ~/.cache)/aser/graphs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aser" / "graphs"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """What a frozen graph is made by besides the weights: this module's and Lite0's code, torch's version."""
    from . import lite0

    digest = hashlib.sha256(torch.__version__.encode())
    for path in (Path(__file__), Path(lite0.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cached_session(name: str, export, open_graph):
    """`open_graph(graph)` of the graph `name` from the file cache, or of `export()` kept there (written whole, then
    renamed; a cache that cannot be written costs the next process the export again). A file that is not what was
    written (its sha256 in the `.sha256` file beside it: a block zeroed in a weight still parses, and would answer
    wrong) or that the runtime refuses is exported again."""
    path = graph_cache_dir() / f"{name}-{_code_digest()}.onnx"
    digest_path = path.with_suffix(".sha256")
    with contextlib.suppress(OSError):
        graph = path.read_bytes()
        try:
            if hashlib.sha256(graph).hexdigest() != digest_path.read_text().strip():
                raise ValueError("its sha256 is not the one written")
            return open_graph(graph)
        except Exception as exc:  # onnxruntime's own errors too: a damaged file is exported again
            log.warning("the cached graph %s could not be used (%s): exported again", path, exc)
    graph = export()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in [*path.parent.glob(f"{name}-*.onnx"), *path.parent.glob(f"{name}-*.sha256")]:  # earlier ones
            stale.unlink()
        _write_whole(digest_path, hashlib.sha256(graph).hexdigest().encode())
        _write_whole(path, graph)
    return open_graph(graph)


def _write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a temporary file renamed)."""
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        try:
            f.write(data)
            f.close()
            os.replace(f.name, path)
        except OSError:  # a full disk: no half-written file left to eat the space
            os.unlink(f.name)
            raise


def session_of(graph: bytes, arena: bool = True):
    """An onnxruntime session of `graph`, on as many threads as torch uses now; `arena` False: no buffers kept
    between runs (a session that runs seldom, or beside others)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # the learner shares its cores with the HTTP server and the training step: idle threads sleep
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # a small device's memory: no planned buffers kept between runs, no repacked copy of the weights (40 MB
    # less at 160 px, the same speed here)
    options.enable_mem_pattern = False
    options.enable_cpu_mem_arena = arena
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.log_severity_level = 3
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; elsewhere nothing): memory a
    library freed stays in the process otherwise."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class FrozenGraphs:
    """The frozen part below `cut` (and above it, for stored latents) as onnxruntime sessions, built
    at first use (thread-safe: sessions run concurrently)."""

    def __init__(self, frozen: Lite0, cut: int):
        self.frozen, self.cut = frozen, cut
        self._sessions = {}
        self._lock = threading.Lock()

    def lower(self, images: torch.Tensor, features: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 images [n, 3, H, W] -> (the latent at the cut, float32; with `features` below the
        pooled cut, the pooled features of it as stored in 16 bits, else None)."""
        features = features and self.cut < POOLED
        size = self.frozen.input_size
        session = self._session(("lower", features), lambda: _Lower(self.frozen, self.cut, features),
                                lambda: (3, size, size), 2 if features else 1)
        outs = [session.run(None, {"x": resize_pixels(chunk, size).numpy()}) for chunk in images.split(RUN_BATCH)]
        return _joined([o[0] for o in outs]), _joined([o[1] for o in outs]) if features else None

    def upper(self, latent: torch.Tensor) -> torch.Tensor:
        """Float latents at the cut -> the frozen network's pooled features [n, 1280]."""
        if self.cut == POOLED:
            return latent.float()
        session = self._session("upper", lambda: _Upper(self.frozen, self.cut),
                                lambda: self.frozen.latent_shape(self.cut), 1)
        return _run_latents(session, latent)

    def release_buffers(self) -> None:
        """Give back what the pixels' session keeps from its largest run (its arena: about 30 MB after runs of 10
        images at 160 px), by a run of one blank image that shrinks it: before a sleep, whose batches want the memory
        and which runs no pixels (docs/results/sleep.md). The next run of 10 grows it again."""
        import onnxruntime as ort

        shrink = ort.RunOptions()
        shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        blank = np.zeros((1, 3, self.frozen.input_size, self.frozen.input_size), np.float32)
        for key, session in list(self._sessions.items()):
            if self._keeps_arena(key):
                session.run(None, {"x": blank}, shrink)
        trim_heap()

    @staticmethod
    def _keeps_arena(key) -> bool:
        """The pixels' sessions keep an arena (without it 1.6-5% more CPU here); the stored latents' pass, which a
        sleep's top adds, none (docs/results/sleep.md)."""
        return key != "upper"

    def _session(self, key, module, shape, outputs: int):
        """The session `key`, built at first use from `module()` on inputs of `shape()` a sample."""
        if key not in self._sessions:
            with self._lock:
                if key not in self._sessions:
                    name = (f"lite0-{self.frozen.weights_sha256[:16]}-{self.frozen.input_size}px-cut{self.cut}-"
                            + "-".join(map(str, key if isinstance(key, tuple) else (key,))))
                    self._sessions[key] = cached_session(
                        name, lambda: onnx_graph_apart(module(), torch.zeros(2, *shape()), outputs),
                        lambda graph: session_of(graph, arena=self._keeps_arena(key)))
                    trim_heap()  # the graph's bytes, read or exported, back to the system
        return self._sessions[key]

    def __deepcopy__(self, memo):  # sessions are not copied: a copy builds its own at first use
        return FrozenGraphs(self.frozen, self.cut)

    def __getstate__(self):
        return {"frozen": self.frozen, "cut": self.cut}

    def __setstate__(self, state):
        self.__init__(state["frozen"], state["cut"])


class _TopFeatures(nn.Module):
    def __init__(self, top: nn.Module):
        super().__init__()
        self.top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top.features(x)


class TopGraph:
    """A copy of a trained top's eval-mode features (float latents at the cut -> its pooled features) in
    onnxruntime, RUN_BATCH latents a run: 3.1x faster than PyTorch's eager forward at 10 latents of 160 px and 4.2x
    at one, on one thread of this project's machine, for about 5 CPU s to build in a child process
    (docs/results/sleep.md). Worth it where the weights hold for many passes: a top trained only in sleeps, between
    two of them."""

    def __init__(self, top: nn.Module, latent_shape: tuple[int, ...]):
        self.session = session_of(onnx_graph_apart(_TopFeatures(top), torch.zeros(2, *latent_shape), 1), arena=False)
        trim_heap()

    def __call__(self, latent: torch.Tensor) -> torch.Tensor:
        return _run_latents(self.session, latent)


def _run_latents(session, latent: torch.Tensor) -> torch.Tensor:
    """A one-output session over float latents, RUN_BATCH a run."""
    return _joined([session.run(None, {"x": chunk.float().contiguous().numpy()})[0]
                    for chunk in latent.split(RUN_BATCH)])


def _joined(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays) if len(arrays) != 1 else arrays[0])
