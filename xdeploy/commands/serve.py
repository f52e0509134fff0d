"""xdeploy serve: a real Triton Inference Server (PyTriton) for an embedding artifact, until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from xdeploy.commands import THREADS_HELP, add_json_option, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="text encoder artifact with a tokenizer (xdeploy export bert --checkpoint DIR), "
                                    "or with --repository a model repository")
    p.add_argument("--repository", action="store_true",
                   help="ARTIFACT is a model repository from `xdeploy triton --graph-backend python`: serve it on "
                        "PyTriton's bundled tritonserver (Python backend only)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--allow-remote", action="store_true", help="allow --host to be a non-loopback address")
    p.add_argument("--http-port", type=int, default=8000,
                   help="HTTP/REST port (default 8000; 0 = a free one, printed and in --json)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0 = a free one)")
    p.add_argument("--model-name", help="Triton model name (default embedder; with --repository: the repository's)")
    p.add_argument("--max-batch-size", type=int, default=32, help="dynamic batching: sentences per batch (default 32)")
    p.add_argument("--max-queue-delay-us", type=int, default=2000,
                   help="dynamic batching: longest wait for more requests, microseconds (default 2000)")
    p.add_argument("--runner", default="ort", help="runner the Embedder uses (default ort)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--tokenizer", choices=("hf", "graph"), default="hf",
                   help="hf tokenizers, or the artifact's tokenizer graph (export --tokenizer-graph)")
    p.add_argument("--max-text-bytes", type=int, default=1 << 22,
                   help="a longer sentence fails its request alone (default 4 MiB)")
    p.add_argument("--no-verify", action="store_true",
                   help="serve the artifact without checking its golden probes on this machine (says so on stderr)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for readiness (default 120)")
    p.add_argument("--log", metavar="FILE", help="append the server's log (tritonserver + PyTriton) to FILE")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.serve.server import ServeOptions, ServerProcess, describe, repository_model_name

    name = args.model_name or (repository_model_name(args.artifact) if args.repository else "embedder")
    opts = ServeOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                        model_name=name, max_batch_size=args.max_batch_size,
                        max_queue_delay_us=args.max_queue_delay_us, runner=args.runner, threads=args.threads,
                        allow_remote=args.allow_remote, tokenizer=args.tokenizer,
                        max_text_bytes=args.max_text_bytes, verify=not args.no_verify)
    srv = ServerProcess(args.artifact, opts, start_timeout=args.start_timeout, log=args.log,
                        repository=args.repository)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with srv:
        info = describe(srv)
        print(f"serving {info['artifact']} as model {opts.model_name!r}: HTTP {srv.http_url}, gRPC {srv.grpc_url} "
              f"(ready: GET http://{srv.http_url}/v2/health/ready); Ctrl-C stops", flush=True)
        write_json(args.json, info)
        while not stop.wait(0.5):
            if srv.proc is not None and srv.proc.poll() is not None:
                print(f"xdeploy serve: the server exited with code {srv.proc.returncode}", file=sys.stderr)
                return 1
    print("stopped", flush=True)
    return 0
