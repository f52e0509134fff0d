"""xdeploy triton: artifact -> Triton Inference Server model repository."""

from __future__ import annotations

import argparse
import dataclasses

from xdeploy.commands import THREADS_HELP, add_json_option, deprecated_alias, write_json
from xdeploy.core.errors import XDeployError
from xdeploy.serve.triton import ACCELERATORS, GRAPH_BACKENDS, KINDS, TOKENIZERS, TritonOptions


def _sizes(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise XDeployError(f"--preferred-batch-sizes must be comma-separated integers, got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="artifact directory (xdeploy export)")
    p.add_argument("--out", metavar="DIR", required=True, help="model repository directory to write")
    p.add_argument("--model-name", dest="name", help="Triton model name clients call (default: the artifact's "
                   "model family)")
    deprecated_alias(p, "--name", "--model-name")
    p.add_argument("--max-batch-size", type=int, default=32, help="Triton max_batch_size (default 32)")
    p.add_argument("--instances", type=int, default=1, help="model instances (default 1)")
    p.add_argument("--kind", choices=KINDS, default="cpu", help="instance kind (default cpu)")
    p.add_argument("--accelerator", choices=ACCELERATORS, default="none",
                   help="ONNX Runtime execution accelerator: openvino (cpu) or tensorrt (gpu)")
    p.add_argument("--max-queue-delay-us", type=int, default=2000,
                   help="dynamic batching: longest wait to form a batch, microseconds (default 2000)")
    p.add_argument("--preferred-batch-sizes", default="", metavar="N,N",
                   help="dynamic batching preferred sizes (default: powers of two from 4 to max-batch-size)")
    p.add_argument("--engine", metavar="PLAN", help="serve this TensorRT engine (platform tensorrt_plan) "
                                                   "instead of the ONNX graph; needs --kind gpu")
    p.add_argument("--graph-backend", choices=GRAPH_BACKENDS, default="onnxruntime",
                   help="onnxruntime: platform onnxruntime_onnx (default); python: a Python-backend model running "
                        "onnxruntime, for Triton builds without the onnxruntime backend (e.g. PyTriton's)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="hf",
                   help="text encoders' tokenizer step: hf = HF tokenizers on the artifact's tokenizer.json in a "
                        "Python-backend model, the Embedder's and the C++ runtime's exact ids (default); graph = the "
                        "artifact's tokenizer graph (export --tokenizer-graph) on the onnxruntime backend, not exact "
                        "on every input (docs/embedding.md)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--extensions-library", metavar="SO",
                   help="onnxruntime-extensions library path on the server, for the tokenizer graph step "
                        "(default: the one installed here)")
    p.add_argument("--force", action="store_true", help="replace an existing repository directory")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.serve.triton import write_repository

    opts = TritonOptions(max_batch_size=args.max_batch_size, instances=args.instances, kind=args.kind,
                         accelerator=args.accelerator, max_queue_delay_us=args.max_queue_delay_us,
                         preferred_batch_sizes=_sizes(args.preferred_batch_sizes), name=args.name,
                         engine=args.engine, threads=args.threads, graph_backend=args.graph_backend,
                         extensions_library=args.extensions_library, tokenizer=args.tokenizer)
    rec = write_repository(args.artifact, args.out, opts, force=args.force)
    print(f"wrote Triton model repository {rec.path}: models {', '.join(rec.models)}; "
          f"clients call {rec.name!r} ({'strings in, vectors out' if rec.text else rec.platform})")
    write_json(args.json, dataclasses.asdict(rec))
    return 0
