"""The code's dependencies point one way: no module imports, at any depth or inside a function, one that
imports it back; `learner/` knows nothing of the service or the clients, the service nothing of the clients;
and inside `learner/` and `service/` each folder imports only the ones its `__init__` names (docs/learner.md,
docs/operations.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("learner", "service", "clients")
# what each of learner's folders may import of the rest of learner (the top-level modules: `formats`, None)
LEARNER_LAYERS = {"formats": set(), "networks": set(), "memory": {"networks"}, "heads": {"networks"},
                  "methods": {"networks", "memory", "heads"}, None: {"formats"}}
# the same for service's folders; its top-level modules (settings, metrics, the two programs) may import any
SERVICE_LAYERS = {"storage": set(), "learning": {"storage"}, "web": {"learning", "storage"}}
SERVICE_SHARED = {"service", "service.settings", "service.metrics"}  # what every folder may read
# the same for the benchmark's folders (clients/bench/__init__.py)
BENCH_LAYERS = {"stream": set(), "live": {"stream"}, "cost": {"stream", "live"}}
BENCH_SHARED = {"clients.bench.results", "clients.bench.machine"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The project's modules `name` imports anywhere in its file (a `from package import module` names
    the module; a package's own `__init__` is not counted for its modules)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert len(GRAPH) > 80 and sum(map(len, GRAPH.values())) > 200  # the graph was read, not empty
    assert cycles() == []


@pytest.mark.parametrize("package,forbidden", [("learner", ("service", "clients")), ("service", ("clients",))])
def test_dependencies_point_one_way(package, forbidden):
    wrong = {f"{m} -> {d}" for m, deps in GRAPH.items() if m.split(".")[0] == package
             for d in deps if d.split(".")[0] in forbidden}
    assert not wrong


def test_each_learner_folder_imports_only_the_folders_below_it():
    wrong = []
    for m, deps in GRAPH.items():
        parts = m.split(".")
        if parts[0] != "learner" or len(parts) < 2:
            continue
        home = parts[1] if parts[1] in LEARNER_LAYERS else None  # None: a top-level module
        allowed = LEARNER_LAYERS.get(home, set()) | {home}
        wrong += [f"{m} -> {d}" for d in deps if d.startswith("learner.") and d.split(".")[1] not in allowed]
    assert not wrong


@pytest.mark.parametrize("package,layers,shared", [
    ("service", SERVICE_LAYERS, SERVICE_SHARED),
    ("clients.bench", BENCH_LAYERS, BENCH_SHARED | {"clients.bench.benchmark", "clients.api", "clients.onnx_client"})])
def test_each_folder_of_the_service_and_the_benchmark_imports_only_the_folders_below_it(package, layers, shared):
    depth = package.count(".") + 1  # where the folder's name is in a module's dotted name

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[depth] if module.startswith(package + ".") and len(parts) > depth + 1 else None

    wrong = []
    for m, deps in GRAPH.items():
        if folder(m) not in layers:
            continue
        allowed = layers[folder(m)] | {folder(m)}
        wrong += [f"{m} -> {d}" for d in deps
                  if d.startswith(package.split(".")[0]) and d not in shared and folder(d) not in allowed]
    assert not wrong
    assert all(any(m.startswith(f"{package}.{f}.") for m in GRAPH) for f in layers)  # the folders exist


def test_the_checker_finds_a_cycle():
    """The check above can fail: a cycle added to the graph is found."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["learner.networks.reduced_resnet"].add("learner.methods.base")
        assert any("learner.methods.base" in c for c in cycles())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_start_up_asks_which_learner_once_and_hands_the_answer_down(tmp_path):
    """From `create_app` down, the settings object reaches each module along one path at most once (no
    A -> B -> A), and the lineage only from the app's check and the runtime's start-up: the worker receives
    the answers (`LearnerSpec`, `LoopSpec`), not the settings and a question (the worker once asked it again).
    In the order of the calls, the settings walk returns to a module it had left only for the lineage's two
    questions (it returned 12 times when the worker and each router read the settings themselves)."""
    import sys

    from service.learning.runtime import Runtime
    from service.metrics import Metrics
    from service.settings import Settings
    from service.web.app import create_app

    settings = Settings(data_dir=tmp_path, backbone="scratch", device="cpu")
    paths, walk = set(), []

    def record(frame, event, arg):
        if not frame.f_globals.get("__name__", "").startswith("service"):
            return
        code = frame.f_code
        given = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if frame.f_locals.get("self") is settings or not any(a is settings for a in given):
            return
        walk.append(frame.f_globals["__name__"])
        path = []
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("service") and module not in path[-1:]:
                path.append(module)
            frame = frame.f_back
        paths.add(tuple(reversed(path)))

    sys.settrace(record)  # calls only (the hook returns None: no line events)
    try:
        create_app(settings)
        runtime = Runtime.open(settings, Metrics())
    finally:
        sys.settrace(None)
    runtime.close()
    assert ("service.learning.runtime", "service.learning.worker") in paths  # the trace saw the start-up
    assert [p for p in paths if len(set(p)) < len(p)] == []
    assert {p for p in paths if "service.learning.lineage" in p} == {("service.web.app", "service.learning.lineage"),
                                                                     ("service.learning.runtime",
                                                                      "service.learning.lineage")}
    rooms = [m for i, m in enumerate(walk) if i == 0 or walk[i - 1] != m]
    returns = [m for i, m in enumerate(rooms) if m in rooms[:i]]
    assert len(returns) <= 2 and set(returns) <= {"service.learning.lineage", "service.learning.runtime"}, returns
