"""`aser`: a folder of photos in, a model and its report out, over the service's HTTP API.

    aser serve                              # the service on its settings (ASER_* variables), as python -m service
    aser add photos/                        # photos/<class>/*.jpg: every photo, labelled by its folder
    aser add --label cat cat1.jpg cat2.png  # files with one label
    aser predict photo.jpg --k 3 [--json | --csv]
    aser evaluate held-out/ [--onnx model.onnx] [--report report.md] [--confusion confusion.png]
    aser snapshot -o model.onnx
    aser status [--watch]
    aser sleep [--fresh]                    # with ASER_SLEEP: train the top now (--fresh: from ImageNet's again)
    aser forget LABEL --yes
    aser suspects [--limit 20] [--recent N] [--json]  # the samples most likely mislabelled (ASER's values)
    aser relabel SEQ LABEL                  # a sample's right label
    aser forget-sample SEQ --yes

The service is `--url` (or ASER_URL; http://127.0.0.1:8000), the token `--token` (or ASER_TOKEN). A sample's id is
derived from its label and its file's bytes, and `add` keeps a journal of what the service acknowledged (beside the
folder's parent in `.aser-sent`, or `--journal`): run again, after a kill or with more photos, it sends only what is
not acknowledged, and whatever was in flight is stored once (the service knows the ids). Every failure is one line on
stderr and a non-zero exit: 1 the service refused something, 2 a usage error (nothing to send, a bad path), 3 no
service answers.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import httpx

from clients.api import Retry, ServiceClient, ServiceError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}  # what the service reads (docs/api.md)
DEFAULT_URL = "http://127.0.0.1:8000"
PREDICT_CHUNK = 32  # images a /predict request (the service takes up to ASER_MAX_PREDICT_IMAGES)


class CliError(Exception):
    """One line for the user, and the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# --- finding photos ------------------------------------------------------------------------------------------
def images_under(path: Path) -> list[Path]:
    """Image files under `path` (a file, or a folder searched recursively), in name order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CliError(f"{path}: no such file or folder")
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def labelled_images(paths: list[Path], label: str | None) -> list[tuple[str, Path]]:
    """(label, file): with `label`, every image under `paths`; else each path is a folder of class folders
    (the image-folder convention: folder/<class>/...), each class's images found recursively.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for name in ("cat/a.jpg", "cat/more/b.PNG", "dog/c.jpeg", "dog/notes.txt"):
    ...     (root / name).parent.mkdir(parents=True, exist_ok=True); _ = (root / name).write_bytes(b"x")
    >>> [(label, p.name) for label, p in labelled_images([root], None)]
    [('cat', 'a.jpg'), ('cat', 'b.PNG'), ('dog', 'c.jpeg')]
    """
    found = []
    for path in paths:
        if label is not None:
            found += [(label, p) for p in images_under(path)]
            continue
        if not path.is_dir():
            raise CliError(f"{path}: give a folder of class folders (folder/<class>/photo.jpg), or --label for files")
        loose = [p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if loose:
            raise CliError(f"{path}: {len(loose)} images outside a class folder ({loose[0].name}); put them in "
                           "folder/<class>/ or give --label")
        for folder in sorted(p for p in path.iterdir() if p.is_dir()):
            found += [(folder.name, p) for p in images_under(folder)]
    if not found:
        raise CliError("no images found under " + ", ".join(map(str, paths)))
    return found


def sample_id(label: str, data: bytes) -> str:
    """The id of a labelled photo: the same file and label, the same id, whoever sends it and however often."""
    return hashlib.sha256(label.encode() + b"\0" + data).hexdigest()[:40]


# --- add ------------------------------------------------------------------------------------------------------
class Journal:
    """The ids the service acknowledged, one a line, appended and flushed after each acknowledgement."""

    def __init__(self, path: Path, url: str):
        self.path = path
        self.key = url.rstrip("/")
        self.done: set[str] = set()
        if path.exists():
            for line in path.read_text().splitlines():
                service, _, ident = line.rpartition(" ")
                if service == self.key:
                    self.done.add(ident)
        self._file = None

    def record(self, ids: list[str]) -> None:
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write("".join(f"{self.key} {i}\n" for i in ids))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.update(ids)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def add(client: ServiceClient, items: list[tuple[str, Path]], journal: Journal, batch: int, progress: bool) -> dict:
    from tqdm import tqdm

    summary = {"found": len(items), "sent": 0, "stored": 0, "already_there": 0, "skipped": 0, "refused": []}
    pending = []
    for label, path in items:
        data = path.read_bytes()
        ident = sample_id(label, data)
        if ident in journal.done:
            summary["skipped"] += 1
        else:
            pending.append((label, path, data, ident))
    bar = tqdm(total=len(pending), unit="photo", desc="sending", disable=not progress, dynamic_ncols=True)
    try:
        for i in range(0, len(pending), batch):
            chunk = pending[i:i + batch]
            try:
                answer = client.add_samples([c[0] for c in chunk], [c[2] for c in chunk], [c[3] for c in chunk])
                accepted = chunk
            except ServiceError as exc:
                if exc.status not in (409, 413, 415, 422):
                    raise
                answer, accepted = alone(client, chunk, summary)  # which file it was
            journal.record([c[3] for c in accepted])
            summary["sent"] += len(accepted)
            summary["stored"] += answer.get("stored", 0)
            summary["already_there"] += answer.get("duplicates", 0)
            bar.update(len(chunk))
    finally:
        bar.close()
        journal.close()
    return summary


def alone(client: ServiceClient, chunk: list, summary: dict) -> tuple[dict, list]:
    """Send a refused batch's photos one by one: the refused ones named with the service's reason."""
    total, accepted = {"stored": 0, "duplicates": 0}, []
    for label, path, data, ident in chunk:
        try:
            answer = client.add_samples([label], [data], [ident])
        except ServiceError as exc:
            if exc.status not in (409, 413, 415, 422):
                raise
            summary["refused"].append({"file": str(path), "status": exc.status, "error": exc.error,
                                       "detail": exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)})
            continue
        accepted.append((label, path, data, ident))
        total["stored"] += answer.get("stored", 0)
        total["duplicates"] += answer.get("duplicates", 0)
    return total, accepted


# --- predict and evaluate ---------------------------------------------------------------------------------------
def predict_files(client: ServiceClient | None, onnx, paths: list[Path], k: int, progress: bool = False) -> list:
    """One answer a file (its top-k labels, `unknown`: "none of these", and its score), from the service or
    (`onnx`) from a downloaded snapshot."""
    from tqdm import tqdm

    answers = []
    with tqdm(total=len(paths), unit="photo", desc="predicting", disable=not progress, dynamic_ncols=True) as bar:
        for i in range(0, len(paths), PREDICT_CHUNK):
            chunk = paths[i:i + PREDICT_CHUNK]
            if onnx is not None:
                answers += onnx.answer([str(p) for p in chunk], k=k)
            else:
                got = client.predict([p.read_bytes() for p in chunk], k=k)
                answers += [{"top": top, "unknown": u, "unknown_score": s}
                            for top, u, s in zip(got["results"], got["unknown"], got["unknown_score"])]
            bar.update(len(chunk))
    return answers


def report(truth: list[str], predicted: list[str], source: str) -> dict:
    """Accuracy, each class's precision, recall and support, and the confusion matrix (rows: the true class).

    >>> r = report(["a", "a", "b", "b"], ["a", "b", "b", "b"], "test")
    >>> r["accuracy"], r["per_class"]["b"]
    (0.75, {'precision': 0.6667, 'recall': 1.0, 'support': 2})
    >>> r["confusion"]["matrix"]
    [[1, 1], [0, 2]]
    """
    labels = sorted(set(truth) | set(predicted))
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for t, p in zip(truth, predicted, strict=True):
        matrix[index[t]][index[p]] += 1
    per_class = {}
    for label in sorted(set(truth)):
        i = index[label]
        called = sum(row[i] for row in matrix)
        per_class[label] = {"precision": round(matrix[i][i] / called, 4) if called else 0.0,
                            "recall": round(matrix[i][i] / sum(matrix[i]), 4), "support": sum(matrix[i])}
    right = sum(t == p for t, p in zip(truth, predicted))
    return {"source": source, "photos": len(truth), "accuracy": round(right / len(truth), 4), "per_class": per_class,
            "confusion": {"labels": labels, "matrix": matrix}}


def markdown(r: dict) -> str:
    lines = [f"# Evaluation ({r['source']})", "", f"{r['photos']} photos, accuracy **{100 * r['accuracy']:.2f}%**", "",
             "| class | precision | recall | support |", "|---|---|---|---|"]
    lines += [f"| {c} | {100 * v['precision']:.1f}% | {100 * v['recall']:.1f}% | {v['support']} |"
              for c, v in r["per_class"].items()]
    labels = r["confusion"]["labels"]
    lines += ["", "Confusion matrix (rows: the true class, columns: the answer):", "",
              "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(map(str, row)) + " |"
              for label, row in zip(labels, r["confusion"]["matrix"])]
    return "\n".join(lines) + "\n"


def confusion_png(r: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise CliError("--confusion draws with matplotlib: pip install 'aser-service[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, matrix = r["confusion"]["labels"], r["confusion"]["matrix"]
    size = max(4.0, 0.6 * len(labels) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("answer")
    ax.set_ylabel("true class")
    ax.set_title(f"{100 * r['accuracy']:.1f}% right of {r['photos']} photos\n{r['source']}", fontsize=9)
    peak = max(max(row) for row in matrix) or 1
    for i, row in enumerate(matrix):
        for j, n in enumerate(row):
            ax.text(j, i, str(n), ha="center", va="center", color="white" if n > peak / 2 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the commands -------------------------------------------------------------------------------------------------
def cmd_add(args, client) -> int:
    items = labelled_images([Path(p) for p in args.paths], args.label)
    default = Path(args.paths[0]).resolve().parent / ".aser-sent"
    journal = Journal(Path(args.journal) if args.journal else default, client.base_url)
    s = add(client, items, journal, args.batch, not args.quiet)
    print(f"{s['found']} photos: {s['sent']} sent ({s['stored']} stored, {s['already_there']} already there), "
          f"{s['skipped']} skipped (acknowledged before), {len(s['refused'])} refused")
    for r in s["refused"]:
        print(f"refused: {r['file']}: {r['status']} {r['error']}: {r['detail']}", file=sys.stderr)
    return 1 if s["refused"] else 0


def cmd_predict(args, client) -> int:
    paths = [p for arg in args.paths for p in images_under(Path(arg))]
    if not paths:
        raise CliError("no images found under " + ", ".join(args.paths))
    onnx = open_onnx(args.onnx)
    answers = predict_files(None if onnx else client, onnx, paths, args.k)
    if args.json:
        print(json.dumps([{"file": str(p), **a} for p, a in zip(paths, answers)], indent=2))
    elif args.csv:
        out = csv.writer(sys.stdout)
        out.writerow(["file", "rank", "label", "probability", "unknown"])
        for p, a in zip(paths, answers):
            out.writerows([str(p), i + 1, t["label"], f"{t['probability']:.6f}", a["unknown"]]
                          for i, t in enumerate(a["top"]))
    else:
        width = max(len(str(p)) for p in paths)
        for p, a in zip(paths, answers):
            print(f"{str(p):<{width}}  " + "  ".join(f"{t['label']} {100 * t['probability']:.1f}%" for t in a["top"])
                  + ("  (none of these?)" if a["unknown"] else ""))
    return 0


def cmd_evaluate(args, client) -> int:
    items = labelled_images([Path(args.folder)], None)
    onnx = open_onnx(args.onnx)
    answers = predict_files(None if onnx else client, onnx, [p for _, p in items], 1, not args.quiet)
    source = f"snapshot {args.onnx} (model version {onnx.model_version})" if onnx else f"service {client.base_url}"
    r = report([label for label, _ in items], [a["top"][0]["label"] for a in answers], source)
    if args.confusion:
        confusion_png(r, Path(args.confusion))
        r["confusion_png"] = args.confusion
    text = json.dumps(r, indent=2) if args.json else markdown(r)
    if args.report:
        Path(args.report).write_text(text + ("\n" if args.json else ""))
    print(text)
    return 0


def cmd_snapshot(args, client) -> int:
    if args.new:
        client.create_snapshot()
    data = client.download_snapshot("latest")
    Path(args.output).write_bytes(data)
    latest = max(client.snapshots(), key=lambda x: x["id"])
    print(f"wrote {args.output} ({len(data) / 2**20:.1f} MB): model version {latest['model_version']}, "
          f"{len(latest['classes'])} classes, {latest['samples_trained']} samples trained")
    return 0


def cmd_status(args, client) -> int:
    while True:
        st = client.status()
        print(status_lines(st), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def status_lines(st: dict) -> str:
    """The dashboard's numbers in a few lines."""
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [f"{time.strftime('%H:%M:%S')}  {st['method']} on {st['device']}, model version {st['model_version']}, "
             f"head {st['serving_head']}",
             f"  samples: {st['samples_received']} received, {st['samples_trained']} trained, backlog {st['backlog']}, "
             f"lag {st['lag']['seconds']:.1f} s",
             f"  online accuracy {pct(st['online']['accuracy'])} (last {st['online']['window']}: "
             f"{pct(st['online']['window_accuracy'])}), {len(st['classes'])} classes, memory {st['buffer_size']}"]
    if st.get("sleep"):
        s = st["sleep"]
        progress = s["progress"]
        lines.append(f"  sleep: {s['state']}" + (" (fresh)" if progress and progress.get("fresh") else "") +
                     (f" {progress['updates']}/{progress['budget']}" if progress else "") +
                     f", {s['sleeps']} sleeps, {s['new_samples']} new samples "
                     f"({s.get('new_since_fresh', 0)} since the last fresh, a night's needs "
                     f"{s['schedule'].get('night_min_new', '?')}), store {s['store']['samples']}")
    pixels = st.get("storage", {}).get("pixel_store")
    if pixels:
        lines.append(f"  pixel store: {pixels['samples']} photos, {pixels['bytes'] / 2**20:.1f} of "
                     f"{pixels['capacity_bytes'] / 2**20:.0f} MB")
    for damaged in st.get("damaged_files", []):  # set aside at start-up: docs/operations.md#damaged-files
        lines.append(f"  damaged at start-up: {damaged['file']} ({damaged['reason']}), set aside as "
                     f"{damaged['set_aside_as']}; {damaged['rebuilt']}")
    return "\n".join(lines)


def cmd_forget(args, client) -> int:
    if not args.yes:
        raise CliError(f"forgetting {args.label!r} removes it for good (its samples, memory and snapshots): "
                       "add --yes")
    answer = client.forget_class(args.label)
    print(f"forgot {args.label!r}: " + ", ".join(f"{k} {v}" for k, v in answer.items() if k != "label"))
    return 0


def cmd_suspects(args, client) -> int:
    rows = client.suspects(args.limit, args.recent)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'seq':>8}  {'given':<20} {'the model says':<26} value")
    for r in rows:
        seq = "?" if r["seq"] is None else r["seq"]
        says = f"{r['answer']} ({r['probability']:.2f})"
        print(f"{seq:>8}  {str(r['label']):<20} {says:<26} {r['value']:+.4f}")
    return 0


def cmd_relabel(args, client) -> int:
    answer = client.relabel(args.seq, args.label)
    print(f"sample {args.seq}: {answer['previous_label']!r} -> {answer['label']!r}" + correction_note(answer))
    return 0


def cmd_forget_sample(args, client) -> int:
    if not args.yes:
        raise CliError(f"forgetting sample {args.seq} removes it for good (its pixels, its memory slot, its share of "
                       "the model): add --yes")
    answer = client.forget_sample(args.seq)
    print(f"forgot sample {args.seq} ({answer['previous_label']!r})" + correction_note(answer))
    return 0


def correction_note(answer: dict) -> str:
    if not answer["learned"]:
        return ", before the model learned it"
    where = [w for w, key in (("its memory slot", "in_memory"), ("the held-back samples", "held_back"),
                              ("streaming LDA", "stream_head"), ("the sleep's store", "sleep_store"))
             if answer.get(key)]
    return f"; corrected in {', '.join(where)}" if where else "; the model had nothing of it to correct"


def cmd_sleep(args, client) -> int:
    answer = client.sleep(fresh=args.fresh)
    what = "a fresh sleep (the top from ImageNet's weights again)" if answer["fresh"] else "a sleep"
    print(f"{what} requested: a budget of {answer['budget']} sample-updates, {answer['new_samples']} new samples")
    return 0


def open_onnx(path: str | None):
    if path is None:
        return None
    from clients.onnx_client import OnnxClassifier, SnapshotError

    try:
        return OnnxClassifier(path)
    except SnapshotError as exc:
        raise CliError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aser", description="A folder of photos in, a model and its report out.")
    p.add_argument("--url", default=os.environ.get("ASER_URL", DEFAULT_URL), help="the service (ASER_URL)")
    p.add_argument("--token", default=os.environ.get("ASER_TOKEN"), help="a bearer token (ASER_TOKEN)")
    common = argparse.ArgumentParser(add_help=False)  # the same two after the command: `aser status --url ...`
    common.add_argument("--url", default=argparse.SUPPRESS, help="the service (ASER_URL)")
    common.add_argument("--token", default=argparse.SUPPRESS, help="a bearer token (ASER_TOKEN)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the service (python -m service, its ASER_* settings)", add_help=False)

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    a = command("add", help="send labelled photos: folder/<class>/..., or files with --label")
    a.add_argument("paths", nargs="+")
    a.add_argument("--label", help="the label of every photo given (files or folders)")
    a.add_argument("--batch", type=int, default=20, help="photos a request")
    a.add_argument("--journal", help="where acknowledged ids are kept (default: .aser-sent beside the first path)")
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    pr = command("predict", help="top-k labels of photos")
    pr.add_argument("paths", nargs="+")
    pr.add_argument("--k", "-k", type=int, default=3)
    pr.add_argument("--onnx", help="answer from this snapshot with onnxruntime, no service")
    fmt = pr.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    e = command("evaluate", help="accuracy, per-class precision and recall, confusion matrix on folder/<class>/")
    e.add_argument("folder")
    e.add_argument("--onnx", help="evaluate this snapshot with onnxruntime, no service")
    e.add_argument("--report", help="write the report here (markdown, or JSON with --json)")
    e.add_argument("--confusion", help="write the confusion matrix here as a PNG")
    e.add_argument("--json", action="store_true", help="the report as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    s = command("snapshot", help="download the latest ONNX snapshot")
    s.add_argument("-o", "--output", default="model.onnx")
    s.add_argument("--new", action="store_true", help="export one of the model as it is now first")
    st = command("status", help="the dashboard's numbers")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS")
    f = command("forget", help="forget a class for good")
    f.add_argument("label")
    f.add_argument("--yes", action="store_true", help="yes, for good")
    sl = command("sleep", help="with ASER_SLEEP: train the top over what the device holds, now")
    sl.add_argument("--fresh", action="store_true",
                    help="start the top again from ImageNet's weights and train it over everything held (the CPU of "
                         "offline training)")
    su = command("suspects", help="the remembered samples most likely mislabelled, by ASER's values")
    su.add_argument("--limit", type=int, default=20)
    su.add_argument("--recent", type=int, default=0, metavar="N",
                    help="among the latest N learned samples (their pixels kept), not the memory's")
    su.add_argument("--json", action="store_true")
    r = command("relabel", help="give a sample (its sequence number) its right label")
    r.add_argument("seq", type=int)
    r.add_argument("label")
    fs = command("forget-sample", help="forget one sample (its sequence number) for good")
    fs.add_argument("seq", type=int)
    fs.add_argument("--yes", action="store_true", help="yes, for good")
    return p


COMMANDS = {"add": cmd_add, "predict": cmd_predict, "evaluate": cmd_evaluate, "snapshot": cmd_snapshot,
            "status": cmd_status, "forget": cmd_forget, "sleep": cmd_sleep, "suspects": cmd_suspects,
            "relabel": cmd_relabel, "forget-sample": cmd_forget_sample}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the service itself, with whatever follows (--help lists its settings)
        os.execv(sys.executable, [sys.executable, "-m", "service", *argv[1:]])
    args = build_parser().parse_args(argv)
    offline = getattr(args, "onnx", None) is not None
    try:
        with ServiceClient(args.url, token=args.token, timeout=120, retry=Retry(attempts=3)) as client:
            if not offline:
                reachable(client)
            return COMMANDS[args.command](args, client)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except ServiceError as exc:
        print(f"error: the service answered {exc.status} {exc.error}: {describe(exc)}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"error: no service answers at {args.url} ({type(exc).__name__}); start one with `aser serve`",
              file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted: what was acknowledged is kept; run the same command again to go on", file=sys.stderr)
        return 130


def reachable(client: ServiceClient) -> None:
    """A service answers at the URL (/healthz needs no token), or httpx's TransportError."""
    try:
        client.http.get("/healthz", timeout=5).raise_for_status()
    except httpx.HTTPStatusError as exc:
        raise httpx.ConnectError(f"{client.base_url}/healthz answered {exc.response.status_code}") from None


def describe(exc: ServiceError) -> str:
    if exc.status == 401:
        return "this service needs a token: give --token or set ASER_TOKEN"
    if exc.status == 403:
        return f"the token given may not do this ({exc.detail})"
    if isinstance(exc.detail, list):  # field errors
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in exc.detail)
    return str(exc.detail)


if __name__ == "__main__":
    sys.exit(main())
