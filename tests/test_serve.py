"""A real Triton Inference Server (PyTriton, in the .venv-serve environment) on free loopback ports: concurrent
HTTP and gRPC clients get the in-process Embedder's vectors, malformed requests get error responses while the
server keeps serving, and SIGTERM / Ctrl-C stop it with no process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from serve_env import require_serve_env
from tiny_text import tiny_text_artifact
from tritonclient.utils import InferenceServerException

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.embedder import Embedder
from xdeploy.serve.server import ServeOptions, ServerProcess

SENTENCES = ["A man is playing a guitar.", "", "emoji 🎉🚀 and CJK 日本語のテキスト", "x",
             "The quick brown fox jumps over the lazy dog. " * 20,  # > 64 tokens: truncated like the Embedder
             "Stocks fell sharply on Tuesday after the central bank raised rates.", "Tabs\tand\nnewlines"]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return tiny_text_artifact(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(art, tmp_path_factory):
    require_serve_env()
    log = tmp_path_factory.getbasetemp() / "serve.log"
    srv = ServerProcess(art, ServeOptions(http_port=0, grpc_port=0, max_batch_size=16,
                                          max_queue_delay_us=5000, max_text_bytes=1 << 16), log=log)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(art):
    with Embedder(art) as e:
        yield e


def _http(srv, texts, name="TEXT", dtype="BYTES"):
    with th.InferenceServerClient(srv.http_url) as c:
        inp = th.InferInput(name, [len(texts), 1], dtype)
        if dtype == "BYTES":
            inp.set_data_from_numpy(np.array([[t if isinstance(t, bytes) else t.encode()] for t in texts],
                                             dtype=object))
        else:
            inp.set_data_from_numpy(np.zeros((len(texts), 1), np.float32))
        return c.infer("embedder", [inp]).as_numpy("EMBEDDING")


def _grpc(srv, texts):
    with tg.InferenceServerClient(srv.grpc_url) as c:
        inp = tg.InferInput("TEXT", [len(texts), 1], "BYTES")
        inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
        return c.infer("embedder", [inp]).as_numpy("EMBEDDING")


def test_health_readiness_and_model_config(server):
    with th.InferenceServerClient(server.http_url) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("embedder")
        meta = c.get_model_metadata("embedder")
        assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}]
        assert meta["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 32]}]
        cfg = c.get_model_config("embedder")
        assert cfg["max_batch_size"] == 16 and cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    with tg.InferenceServerClient(server.grpc_url) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("embedder")


def test_concurrent_http_and_grpc_requests_match_the_embedder(server, ref):
    rng = np.random.default_rng(0)
    jobs = []
    for k in range(48):  # 48 requests of 1..5 sentences from 12 threads, half over gRPC
        texts = [SENTENCES[i] + f" #{k}" for i in rng.integers(0, len(SENTENCES), rng.integers(1, 6))]
        jobs.append((k % 2, texts))
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda j: (_grpc if j[0] else _http)(server, j[1]), jobs))
    for (_, texts), got in zip(jobs, outs):
        assert got.shape == (len(texts), 32) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref.embed(texts), atol=2e-6, rtol=0)  # fp32 noise of other batchings


def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, ref):
    with pytest.raises(InferenceServerException, match="not valid UTF-8"):
        _http(server, [b"\xff\xfe not utf-8"])
    with pytest.raises(InferenceServerException, match="(?i)input.*TXT|unexpected inference input"):
        _http(server, ["hello"], name="TXT")
    with pytest.raises(InferenceServerException, match="(?i)datatype|data type|FP32"):
        _http(server, ["hello"], dtype="FP32")
    with th.InferenceServerClient(server.http_url) as c:  # wrong shape: [2] is not [batch, 1]
        inp = th.InferInput("TEXT", [1, 2], "BYTES")
        inp.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
        with pytest.raises(InferenceServerException):
            c.infer("embedder", [inp])
    np.testing.assert_allclose(_http(server, SENTENCES), ref.embed(SENTENCES), atol=2e-6, rtol=0)
    assert server.proc.poll() is None


def test_a_malformed_request_fails_alone_in_a_dynamic_batch(server, ref):
    """A burst of concurrent requests, good ones mixed with bad UTF-8, an oversize sentence, a wrong type and a
    wrong shape: each bad one gets its own clear error, every good one its vectors, and Triton did merge requests
    into shared executions (fewer executions than requests), so bad and good ones shared batches."""
    def executions() -> int:
        with th.InferenceServerClient(server.http_url) as c:
            return int(c.get_inference_statistics("embedder")["model_stats"][0]["execution_count"])

    def wrong_shape(_):
        with th.InferenceServerClient(server.http_url) as c:
            inp = th.InferInput("TEXT", [1, 2], "BYTES")
            inp.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
            return c.infer("embedder", [inp]).as_numpy("EMBEDDING")

    bad = {"utf8": (lambda k: _http(server, [f"ok {k}", b"bad \xff\xfe"]), r"sentence 1 is not valid UTF-8 \(byte 4\)"),
           "oversize": (lambda k: _http(server, ["x " * 40_000]), r"sentence 0 has 80000 bytes; the limit is 65536"),
           "type": (lambda k: _http(server, ["hello"], dtype="FP32"), "(?i)datatype|data type|FP32"),
           "shape": (wrong_shape, "(?i)shape|dims")}
    jobs = []
    for k in range(40):
        kind = ("utf8", "oversize", "type", "shape")[k // 2 % 4] if k % 2 else None
        jobs.append((kind, [SENTENCES[(k + j) % len(SENTENCES)] + f" #{k}" for j in range(1 + k % 3)]))

    def run(job):
        kind, texts = job
        if kind is None:
            return (_grpc if len(texts) % 2 else _http)(server, texts)
        try:
            bad[kind][0](len(texts))
        except InferenceServerException as e:
            return e
        return None

    executions0 = executions()
    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(run, jobs))
    ran = executions() - executions0
    good = 0
    for (kind, texts), got in zip(jobs, outs):
        if kind is None:
            np.testing.assert_allclose(got, ref.embed(texts), atol=2e-6, rtol=0)
            good += 1
        else:
            assert isinstance(got, InferenceServerException), (kind, got)
            assert re.search(bad[kind][1], str(got)), (kind, str(got))
    reached = good + sum(kind in ("utf8", "oversize") for kind, _ in jobs)  # type/shape: refused by Triton
    assert good == 20 and reached == 30
    # the model ran fewer times than requests reached it: requests (good and bad) were merged into batches
    assert ran < reached, (ran, reached)
    assert server.proc.poll() is None


def test_golden_probes_refuse_a_corrupted_artifact_before_triton_starts(art, tmp_path):
    """The serving environment (no torch) runs the artifact's golden probes before tritonserver starts: a corrupted
    artifact is refused with the one line that names the graph, output and cosine; `verify=False` there runs it."""
    from planted import corrupt_artifact

    py = require_serve_env()
    bad = corrupt_artifact(art, tmp_path / "bad")
    srv = ServerProcess(bad, ServeOptions(http_port=0, grpc_port=0), start_timeout=60)
    with pytest.raises(XDeployError, match=r"exited with code 1 while starting: artifact .* fails its golden probes "
                                           r"here: graph 'model' output 'last_hidden_state': cosine ") as e:
        srv.start()
    assert "\n" not in str(e.value) and "machine class: " in str(e.value)
    assert ServeOptions(verify=False).args()[-1] == "--no-verify"
    code = ("import sys; from xdeploy.deploy.embedder import Embedder\n"
            "with Embedder(sys.argv[1], verify=False) as e:\n"
            "    print(e.embed(['a sentence']).shape, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([py, "-c", code, str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "(1, 32) False" in r.stdout, r.stderr
    assert "golden probes not checked on ort" in r.stderr


def test_non_loopback_host_is_refused_before_starting(art):
    with pytest.raises(XDeployError, match="refusing to bind '0.0.0.0'"):
        ServerProcess(art, ServeOptions(host="0.0.0.0"))


def test_loadtest_over_http_and_grpc(server, tmp_path, capsys):
    from xdeploy.cli import main
    from xdeploy.core.records import read_records, validate_record
    from xdeploy.serve.loadtest import LoadOptions, loadtest

    recs = loadtest(f"grpc://localhost:{server.options.grpc_port}",
                    LoadOptions(concurrency=(1, 3), requests=12, time_limit=20, batch=3, warmup=2))
    assert [r["concurrency"] for r in recs] == [1, 3]
    for r in recs:
        validate_record(r)
        assert r["kind"] == "loadtest" and r["protocol"] == "grpc" and r["errors"] == 0 and r["requests"] == 12
        assert r["sentences"] == 36 and r["sentences_per_s"] == pytest.approx(3 * r["requests_per_s"])
        assert 0 < r["latency_s"]["p50"] <= r["latency_s"]["p99"] <= r["timed_s"]
    js, jl = tmp_path / "lt.json", tmp_path / "lt.jsonl"
    assert main(["loadtest", f"http://{server.http_url}", "--concurrency", "2", "--requests", "6",
                 "--json", str(js), "--records", str(jl)]) == 0
    assert "req/s" in capsys.readouterr().out
    (r,) = read_records(jl)
    assert r["protocol"] == "http" and r["requests"] == 6 and json.loads(js.read_text())["records"][0] == r
    for url, msg in [("http://10.0.0.1:8000", "only sends traffic to loopback"), ("ftp://127.0.0.1:1", "scheme"),
                     ("http://127.0.0.1", "needs a port")]:
        with pytest.raises(XDeployError, match=msg):
            loadtest(url)
    with pytest.raises(XDeployError, match="concurrency levels"):
        loadtest(f"http://{server.http_url}", LoadOptions(concurrency=(0,)))


def test_loadtest_of_an_artifact_starts_and_stops_its_own_server(art):
    from xdeploy.serve.loadtest import LoadOptions, loadtest

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    base, level = loadtest(art, LoadOptions(concurrency=(2,), requests=8, batch=2, warmup=1, time_limit=30))
    assert base["server"] == "in-process Embedder" and base["requests"] == 8 and base["protocol"] == "none"
    assert level["server"].startswith("xdeploy serve") and level["requests"] == 8 and level["errors"] == 0
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.name()) for p in left]


def _tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def test_sigterm_stops_the_server_and_leaves_no_process(server):
    procs = _tree(server.pid)
    names = {p.name() for p in procs}
    assert any("tritonserver" in n for n in names), names
    t0 = time.monotonic()
    assert server.stop() == 0  # clean exit on SIGTERM (not killed)
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert time.monotonic() - t0 < 15
    assert not server.ready()


def test_cli_serve_stops_on_ctrl_c(art, tmp_path):
    require_serve_env()
    js = tmp_path / "serve.json"  # ports 0: the server chooses free ones and names them in --json
    p = subprocess.Popen([sys.executable, "-m", "xdeploy.cli", "serve", str(art), "--http-port", "0",
                          "--grpc-port", "0", "--json", str(js), "--log", str(tmp_path / "log")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not js.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        info = json.loads(js.read_text())
        http, grpc = int(info["http"].rpartition(":")[2]), int(info["grpc"].rpartition(":")[2])
        assert info["http"] == f"127.0.0.1:{http}" and info["model"] == "embedder" and 0 not in (http, grpc)
        procs = _tree(info["pid"])
        with tg.InferenceServerClient(f"127.0.0.1:{grpc}") as c:
            assert c.is_model_ready("embedder")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert "stopped" in out
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, [(q.pid, q.name()) for q in alive]
    finally:
        if p.poll() is None:
            p.kill()
