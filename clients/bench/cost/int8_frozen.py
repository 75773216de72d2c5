"""An int8 frozen part: onnxruntime's static quantisation of the default's frozen part (Lite0 at 160 px
up to the pooled features), measured against the float one on the same images, before it may become an
option of the service.

The graph is the learner's own (`learner.networks.frozen_runtime`), quantised in QDQ form (int8 weights per
channel, uint8 activations) with a calibration of 100 training images of the stream (the first ten of
each class, as a service would have them after its first images). Then, on one thread in batches of the
stream's 10: the CPU milliseconds an image of each, and the default's answer on each, streaming LDA on
the pooled features, over the benchmark's protocol (A_T and the anytime accuracy, seeds paired: the
head is order-free at the end, not along the stream). Rule (issue 63): an option made default only if
A_T and anytime stay within 0.5 points and it is faster.

    python -m clients.bench.cost.int8_frozen --dataset eurosat --data ../shared/datasets/eurosat-rgb.zip \\
        --out results/speed/int8-frozen-eurosat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from clients.bench.benchmark import build_parser
from clients.bench.machine import machine_description
from clients.bench.results import write_result
from clients.bench.stream.latents import encoded_dataset
from clients.bench.stream.protocol import run_once
from learner.data import CLASSES, load_dataset
from learner.networks.backbone import PretrainedBackbone
from learner.networks.frozen_runtime import RUN_BATCH, _Lower, onnx_graph, session_of
from learner.networks.lite0 import POOLED, resize_pixels

CALIBRATION_PER_CLASS = 10


def quantised(graph: bytes, calibration: torch.Tensor, size: int) -> bytes:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Images(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": resize_pixels(chunk, size).numpy()} for chunk in calibration.split(RUN_BATCH)])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        source.write_bytes(graph)
        quantize_static(str(source), str(target), Images(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        return target.read_bytes()


def encode(session, images: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([torch.from_numpy(session.run(None, {"x": resize_pixels(chunk, size).numpy()})[0]).half()
                      for chunk in images.split(RUN_BATCH)])


def cpu_ms(session, images: torch.Tensor, size: int) -> float:
    encode(session, images[:RUN_BATCH], size)  # warm-up
    start = time.process_time()
    encode(session, images, size)
    return 1000 * (time.process_time() - start) / len(images)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, choices=sorted(CLASSES))
    p.add_argument("--data", required=True)
    p.add_argument("--input-size", type=int, default=160)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    size = args.input_size
    data = load_dataset(args.dataset, args.data)
    backbone = PretrainedBackbone(input_size=size)
    fp32_graph = onnx_graph(_Lower(backbone.frozen, POOLED, False), torch.zeros(2, 3, size, size), 1)
    calibration = torch.cat([data.train_x[data.train_y == c][:CALIBRATION_PER_CLASS] for c in range(data.num_classes)])
    sessions = {"fp32": session_of(fp32_graph), "int8": session_of(quantised(fp32_graph, calibration, size))}
    timing = data.test_x[:200]
    result = {"dataset": args.dataset, "input_size": size, "cpu_ms_an_image": {}, "runs": {}}
    for name, session in sessions.items():
        result["cpu_ms_an_image"][name] = round(cpu_ms(session, timing, size), 3)
        stored = encoded_dataset(data, backbone) if name == "fp32" else \
            replace(data, train_x=encode(session, data.train_x, size), test_x=encode(session, data.test_x, size))
        run_args = build_parser().parse_args(["run", "--dataset", args.dataset, "--data", args.data, "--method", "slda",
                                              "--backbone", "lite0", "--input-size", str(size), "--quiet"])
        run_args.backbone_object, run_args.frozen_forward_cpu_ms = backbone, result["cpu_ms_an_image"][name]
        runs = [run_once(run_args, stored, seed, progress=False) for seed in range(args.seeds)]
        result["runs"][name] = [{"seed": r["seed"], "average_accuracy": round(r["average_accuracy"], 2),
                                 "anytime": r["anytime"]} for r in runs]
    paired = {}
    for key in ("average_accuracy", "10", "100", "1000"):
        pick = (lambda r, k=key: r[k]) if key == "average_accuracy" else (lambda r, k=key: r["anytime"][k])
        diffs = np.array([pick(b) - pick(a) for a, b in zip(result["runs"]["fp32"], result["runs"]["int8"])])
        paired[key] = {"mean": round(float(diffs.mean()), 2), "min": round(float(diffs.min()), 2),
                       "max": round(float(diffs.max()), 2)}
    result |= {"int8_minus_fp32": paired, "calibration_images": len(calibration), "threads": 1,
               "machine": machine_description(torch.device("cpu")),
               "command": "python -m clients.bench.cost.int8_frozen "
               + " ".join(sys.argv[1:] if argv is None else argv),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("cpu_ms_an_image", "int8_minus_fp32")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
