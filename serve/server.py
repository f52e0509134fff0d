"""A real Triton Inference Server (through PyTriton) serving an embedding artifact: strings in, vectors out.

    with ServerProcess("artifacts/minilm") as srv:          # starts tritonserver on free loopback ports
        srv.http_url, srv.grpc_url                           # "127.0.0.1:PORT"; model "embedder"
    # leaving the block sends SIGTERM; the server stops tritonserver and exits; stragglers are killed

Model `embedder` (name configurable): input TEXT BYTES [-1 batch, 1] (UTF-8), output EMBEDDING FP32 [batch, d];
Triton's dynamic batcher merges concurrent requests (max_batch_size, max queue delay) into one
`Embedder.embed` call (tokenize, length-sorted batches, run, pool from the manifest). The model is a
Python-backend model of our own (serve/triton_embedder_model.py, in a temporary model repository run by
PyTriton's bundled tritonserver): each request of a dynamic batch is checked on its own, so a malformed one
(bad UTF-8, an oversize sentence) gets its own error while the others get their vectors; wrong types/shapes
and batches over max_batch_size are refused by Triton before batching. (PyTriton's `bind` API fails a whole
dynamic batch with one error.) Health/readiness are Triton's own: GET /v2/health/live, /v2/health/ready,
/v2/models/embedder/ready; gRPC ServerReady/ModelReady.

Why a second Python: PyTriton's Python-backend stub fails under this machine's Python 3.11
(`'_thread.RLock' object has no attribute '_recursion_count'`) and works under 3.12 and 3.13, and the server needs no
torch. So the server runs in a lean environment (`make serve-env` -> .venv-serve: Python 3.12, onnxruntime,
tokenizers, numpy, nvidia-pytriton, xdeploy installed --no-deps); `xdeploy serve` in the main environment
launches `python -m xdeploy.serve.server` there. `serve_python()` says which interpreter is used.

Shutdown: SIGINT or SIGTERM -> tritonserver gets SIGTERM (in-flight requests finish), the temporary
repository is removed -> exit 0. The launcher puts the server in its own process group and kills the group if
it has not exited after `stop_timeout` seconds, so no tritonserver is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
READY_MARK = "XDEPLOY-SERVE-READY"
SERVE_ENV = Path(__file__).resolve().parents[1] / ".venv-serve"  # repository checkout: make serve-env


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    model_name: str = "embedder"
    max_batch_size: int = 32  # sentences per Triton batch (= per Embedder.embed call)
    max_queue_delay_us: int = 2000  # dynamic batcher: longest wait for more requests
    runner: str = "ort"
    threads: int = 0  # runner threads (0 = backend default)
    allow_remote: bool = False  # bind a non-loopback host only when asked
    tokenizer: str = "hf"  # Embedder tokenizer: hf | graph (the artifact's tokenizer graph)
    max_text_bytes: int = 1 << 22  # a longer sentence fails its request (4 MiB; the Embedder cuts long lines)
    verify: bool = True  # check the artifact's golden probes before serving (deploy/probes.py); False: say so, serve

    def args(self) -> list[str]:
        return ["--host", self.host, "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                "--model-name", self.model_name, "--max-batch-size", str(self.max_batch_size),
                "--max-queue-delay-us", str(self.max_queue_delay_us), "--runner", self.runner,
                "--threads", str(self.threads), "--tokenizer", self.tokenizer, "--max-text-bytes",
                str(self.max_text_bytes)] + (["--allow-remote"] if self.allow_remote else []) \
            + ([] if self.verify else ["--no-verify"])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def with_free_ports(options: ServeOptions) -> ServeOptions:
    """Port 0 means "a free loopback port": choose one now (two distinct ones where both are 0)."""
    http = options.http_port or free_port(options.host)
    grpc = options.grpc_port or free_port(options.host)
    while grpc == http:
        grpc = free_port(options.host)
    return replace(options, http_port=http, grpc_port=grpc)


def check_host(host: str, allow_remote: bool) -> None:
    if host not in LOOPBACK and not allow_remote:
        raise XDeployError(f"refusing to bind {host!r}: the server binds loopback (127.0.0.1) unless "
                           "--allow-remote is given")


def _can_serve_here() -> bool:
    if sys.version_info < (3, 12):  # the PyTriton stub problem above
        return False
    from xdeploy.core.deps import installed

    return installed("pytriton")


def serve_python() -> str:
    """The interpreter that runs the server: $XDEPLOY_SERVE_PYTHON, this one if it can, or .venv-serve's."""
    env = os.environ.get("XDEPLOY_SERVE_PYTHON")
    if env:
        if not Path(env).exists():
            raise XDeployError(f"XDEPLOY_SERVE_PYTHON={env} does not exist")
        return env
    if _can_serve_here():
        return sys.executable
    py = SERVE_ENV / "bin" / "python"
    if not py.exists():
        raise XDeployError(f"no serving environment: {py} is missing; create it with `make serve-env` "
                           "(Python 3.12 + nvidia-pytriton), or set XDEPLOY_SERVE_PYTHON")
    return str(py)


# ------------------------------------------------------------------------- the server (serving env) ----

def _libdir() -> str:
    import sysconfig

    return str(sysconfig.get_config_var("LIBDIR") or "")


def write_embedder_repository(artifact: str | Path, repo: Path, options: ServeOptions) -> int:
    """A one-model Triton repository serving the artifact through the Embedder (serve/triton_embedder_model.py,
    Python backend): TEXT BYTES [n, 1] -> EMBEDDING FP32 [n, d] with dynamic batching. Returns d."""
    import shutil

    from xdeploy.deploy.embedder import Embedder
    from xdeploy.serve.triton import _pb, to_pbtxt

    art = Path(artifact).resolve()
    # one-line errors here, before tritonserver starts; the golden probes run here on first open (a failure refuses
    # to serve; the model's own Embedder below then finds the pass remembered)
    with Embedder(art, runner=options.runner, batch_size=min(options.max_batch_size, 32), threads=options.threads,
                  tokenizer=options.tokenizer, verify=options.verify) as emb:
        dim = emb.dim
        emb.tokenizer  # noqa: B018 - loads the tokenizer: an artifact without one fails here, not per request
    pb = _pb()
    cfg = pb.ModelConfig(name=options.model_name, backend="python", max_batch_size=options.max_batch_size)
    cfg.input.add(name="TEXT", data_type=pb.TYPE_STRING, dims=[1])
    cfg.output.add(name="EMBEDDING", data_type=pb.TYPE_FP32, dims=[dim])
    cfg.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    cfg.instance_group.append(pb.ModelInstanceGroup(count=1, kind=pb.ModelInstanceGroup.KIND_CPU))
    for k, v in {"artifact": str(art), "runner": options.runner, "threads": str(options.threads),
                 "tokenizer": options.tokenizer, "batch_size": str(min(options.max_batch_size, 32)),
                 "max_text_bytes": str(options.max_text_bytes), "verify": str(options.verify).lower()}.items():
        cfg.parameters[k].string_value = v
    (repo / options.model_name / "1").mkdir(parents=True)
    (repo / options.model_name / "config.pbtxt").write_text(to_pbtxt(cfg), encoding="utf-8")
    shutil.copyfile(Path(__file__).parent / "triton_embedder_model.py", repo / options.model_name / "1" / "model.py")
    return dim


def run_server(artifact: str | Path, options: ServeOptions, *, stop: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or `stop` is set, or tritonserver dies). Runs in the serving environment.

    The model is the Embedder in a Python-backend model of our own (serve/triton_embedder_model.py) on PyTriton's
    bundled tritonserver, not PyTriton's `bind`: a bound infer function can only fail a whole dynamic batch,
    while this model answers a malformed request with its own error and the others with their vectors."""
    import tempfile

    check_host(options.host, options.allow_remote)
    with tempfile.TemporaryDirectory(prefix="xdeploy-serve-") as tmp:
        repo = Path(tmp) / "repo"
        dim = write_embedder_repository(artifact, repo, options)
        ready_line = (f"{READY_MARK} http={options.host}:{options.http_port} grpc={options.host}:{options.grpc_port} "
                      f"model={options.model_name} dim={dim}")
        return run_repository(repo, options, stop=stop, ready_line=ready_line)


def run_repository(repo: str | Path, options: ServeOptions, *, stop: threading.Event | None = None,
                   ready_line: str | None = None) -> int:
    """Run PyTriton's bundled tritonserver on a model repository until SIGINT/SIGTERM. That build has only the
    Python backend: serve repositories written with `xdeploy triton --graph-backend python`. Runs in the serving
    environment (its numpy/tokenizers/onnxruntime are what the Python-backend models import)."""
    import shutil
    import tempfile

    import pytriton

    check_host(options.host, options.allow_remote)
    root = Path(pytriton.__file__).parent / "tritonserver"
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    stub = root / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="xdeploy-tritonserver-") as tmp:
        backends = Path(tmp) / "backends"
        shutil.copytree(root / "backends", backends)
        shutil.copy(stub, backends / "python" / "triton_python_backend_stub")  # the stub of this Python
        env = dict(os.environ)
        # the stub embeds the Python found on PATH: put this environment's first so models import its packages
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (env.get("LD_LIBRARY_PATH"), str(libs), _libdir()) if p)
        cmd = [str(root / "bin" / "tritonserver"), "--model-repository", str(Path(repo).resolve()),
               "--backend-directory", str(backends), "--http-address", options.host, "--http-port",
               str(options.http_port), "--grpc-address", options.host, "--grpc-port", str(options.grpc_port),
               "--allow-metrics", "false", "--exit-timeout-secs", "5", "--exit-on-error", "true",
               # the stub imports numpy/onnxruntime/tokenizers: on a loaded 2-core machine that can pass the
               # backend's 30 s default, and the model then fails to load
               "--backend-config", "python,stub-timeout-seconds=120"]
        proc = subprocess.Popen(cmd, env=env)
        url = f"http://{options.host}:{options.http_port}/v2/models/{options.model_name}/ready"
        try:
            while not stop.wait(0.5):
                if ready_line and _ready(url):  # say so once, for a supervisor reading our output
                    print(ready_line, flush=True)
                    ready_line = None
                if proc.poll() is not None:
                    print(f"xdeploy serve: tritonserver exited with code {proc.returncode}", file=sys.stderr)
                    return 1
            proc.send_signal(signal.SIGTERM)
            try:
                return 0 if proc.wait(15) == 0 else 1
            except subprocess.TimeoutExpired:
                return 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # loopback only (check_host)
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.serve.server")
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--model-name", default="embedder")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-queue-delay-us", type=int, default=2000)
    p.add_argument("--runner", default="ort")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--tokenizer", choices=("hf", "graph"), default="hf")
    p.add_argument("--max-text-bytes", type=int, default=1 << 22)
    p.add_argument("--repository", action="store_true", help="ARTIFACT is a Triton model repository")
    p.add_argument("--no-verify", action="store_true", help="serve without checking the golden probes")
    a = p.parse_args(argv)
    opts = ServeOptions(host=a.host, http_port=a.http_port, grpc_port=a.grpc_port, model_name=a.model_name,
                        max_batch_size=a.max_batch_size, max_queue_delay_us=a.max_queue_delay_us, runner=a.runner,
                        threads=a.threads, allow_remote=a.allow_remote, tokenizer=a.tokenizer,
                        max_text_bytes=a.max_text_bytes, verify=not a.no_verify)
    try:
        return run_repository(a.artifact, opts) if a.repository else run_server(a.artifact, opts)
    except XDeployError as e:
        print(f"xdeploy: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


# ------------------------------------------------------------------------- the launcher (any env) ----

def repository_model_name(repo: str | Path) -> str:
    """The model clients call in a repository written by `xdeploy triton` (from its xdeploy-triton.json)."""
    rec = Path(repo) / "xdeploy-triton.json"
    try:
        return str(json.loads(rec.read_text(encoding="utf-8"))["name"])
    except (OSError, ValueError, KeyError, TypeError):
        raise XDeployError(f"{repo} is not a model repository written by `xdeploy triton` "
                           f"(no readable {rec.name})") from None


_TRITON_ERROR = re.compile(r"^E\d{4} \d")


class ServerProcess:
    """Start the server in the serving environment as a child process group; stop it and everything under it."""

    def __init__(self, artifact: str | Path, options: ServeOptions | None = None, *, start_timeout: float = 120.0,
                 stop_timeout: float = 20.0, log: str | Path | None = None, python: str | None = None,
                 repository: bool = False) -> None:
        from xdeploy.export.artifact import load_artifact

        self.repository = repository
        if repository:  # a model repository from `xdeploy triton`; clients call the name it records
            self.artifact = Path(artifact)
            options = options or ServeOptions(http_port=0, grpc_port=0, model_name=repository_model_name(artifact))
        else:  # one-line errors before a process is started: not an artifact, not a text encoder, no tokenizer
            from xdeploy.deploy.embedder import check_text_artifact

            self.artifact = check_text_artifact(load_artifact(artifact),
                                                tokenizer=(options.tokenizer if options else "hf")).path
        # port 0: a free port, chosen at each start (a port found free can be taken by another process before
        # tritonserver binds it; start() then chooses again)
        self.requested = options or ServeOptions(http_port=0, grpc_port=0)
        self.options = with_free_ports(self.requested)
        check_host(self.options.host, self.options.allow_remote)
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.python = python or serve_python()
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def ready(self) -> bool:
        return _ready(f"http://{self.http_url}/v2/models/{self.options.model_name}/ready")

    def start(self) -> ServerProcess:
        """Start and wait until the model is ready. Where a port asked for as 0 was taken by another process
        between choosing and binding it, start again on newly chosen ports (at most twice more)."""
        starts = 1
        while taken := self._start_once():
            asked = [p for p in taken if p in (self.requested.http_port, self.requested.grpc_port)]
            if asked or starts == 3:
                ports = ", ".join(str(p) for p in taken)
                raise XDeployError(f"the Triton server could not bind {self.options.host} port {ports}: another "
                                   "process holds it" + ("; choose other ports (0 = a free one)" if asked else ""))
            self.options = with_free_ports(self.requested)  # the ports asked for as 0 chosen again
            starts += 1
        return self

    def _start_once(self) -> list[int]:
        """One start: [] once ready; the ports another process holds if the server exited while starting and one
        of its ports is now held; any other failure raises."""
        # without --log the output goes to a temporary file, read back when the server fails to start
        out = open(self.log, "ab") if self.log else tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the serving env has its own site-packages
        # own session/process group: stop() can reach tritonserver and the Python-backend stubs under it
        self.proc = subprocess.Popen([self.python, "-m", "xdeploy.serve.server", str(self.artifact),
                                      *self.options.args(), *(["--repository"] if self.repository else [])],
                                     stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._out = out
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                why = self._last_error()
                self.stop()
                taken = [p for p in (self.options.http_port, self.options.grpc_port)
                         if port_in_use(self.options.host, p)]
                if taken:
                    return taken
                raise XDeployError(f"the Triton server exited with code {code} while starting"
                                   + (f": {why}" if why else "")
                                   + (f"; the full log is in {self.log}" if self.log else
                                      "; pass --log FILE (`xdeploy serve`) or log=FILE (ServerProcess) for the "
                                      "full log"))
            if self.ready():
                return []
            time.sleep(0.25)
        self.stop()
        raise XDeployError(f"the Triton server was not ready after {self.start_timeout:.0f} s")

    def _last_error(self) -> str:
        """The server's own one-line error (`xdeploy: error: ...`), or its last line, from its output so far."""
        try:
            if self.log:
                lines = self.log.read_bytes()[-20000:].decode("utf-8", "replace").splitlines()
            else:
                self._out.seek(0)
                lines = self._out.read()[-20000:].decode("utf-8", "replace").splitlines()
        except (OSError, ValueError):
            return ""
        lines = [ln.strip() for ln in lines if ln.strip()]
        errors = [ln.removeprefix("xdeploy: error: ") for ln in lines if ln.startswith("xdeploy: error: ")]
        # tritonserver's own error lines ("E1124 14:30:22.123 41 server.cc:251] failed to ..."): the cause, where
        # our last line would only say that it exited
        # (not the CUDA line every start prints on a machine without a GPU driver)
        triton = [ln for ln in lines if _TRITON_ERROR.match(ln) and "CudaDriverHelper" not in ln]
        if errors:
            return errors[-1][:600]
        if triton:
            return "; ".join(triton[-2:])[:600]
        return lines[-1][:600] if lines else ""

    def stop(self) -> int | None:
        """SIGTERM, wait for a clean exit, then SIGKILL whatever is left in the process group. Returns the exit
        code of the server process (None if it had to be killed)."""
        if self.proc is None:
            return None
        code: int | None = None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers (a hung tritonserver or stub)
        if code is None:
            self.proc.wait(10)
        if self._out is not subprocess.DEVNULL:  # a file: --log, or the temporary one
            self._out.close()
        self.proc = None
        return code

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def describe(srv: ServerProcess) -> dict[str, Any]:
    return {"http": srv.http_url, "grpc": srv.grpc_url, "model": srv.options.model_name, "python": srv.python,
            "artifact": str(srv.artifact), "pid": srv.pid}


if __name__ == "__main__":
    sys.exit(main())
