"""Bounded load test of a Triton embedding server, from loopback only.

    from xdeploy.serve.loadtest import LoadOptions, loadtest
    records = loadtest("http://127.0.0.1:8000", LoadOptions(concurrency=(1, 4, 16), requests=200))
    records = loadtest("artifacts/minilm")          # starts a server (xdeploy serve), tests it, stops it

For each concurrency level c, c client threads (each with its own tritonclient connection) send requests of
`batch` sentences (TEXT BYTES [batch, 1]) until `requests` requests were sent or `time_limit` seconds passed,
whichever comes first: every loop stops by itself. Each request is timed alone (perf_counter around infer), so
p50/p90/p99 are per-request latencies under that load; requests/s and sentences/s count successful requests
over the level's wall time. Before the levels, `warmup` requests are sent and not counted.

Records are `kind: "loadtest"` bench records (xdeploy.core.records): floats in seconds, validated.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

from .server import LOOPBACK, ServeOptions, ServerProcess

PROTOCOLS = ("http", "grpc")
_TEXT = ("the model serves sentence embeddings over http and grpc with dynamic batching on two cpu cores while "
          "clients send short and long requests about weather markets music science travel cooking sports code "
          "and the server answers each one with a normalized vector")
_WORDS = _TEXT.split(" ")


@dataclass(frozen=True)
class LoadOptions:
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 200  # per level (upper bound)
    time_limit: float = 30.0  # seconds per level (upper bound)
    batch: int = 4  # sentences per request
    protocol: str = "http"
    model: str = "embedder"
    warmup: int = 8
    timeout: float = 60.0  # per request (client side)
    baseline: bool = True  # ARTIFACT target: first time the same requests on the in-process Embedder (no server)


def corpus(n: int, seed: int = 0) -> list[str]:
    """n deterministic sentences of 3..60 words (lengths drawn log-uniformly: many short, some long)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(3), np.log(60), n)).astype(int)
    return [" ".join(rng.choice(_WORDS, k)) + "." for k in lengths]


def parse_target(url: str, protocol: str) -> tuple[str, str]:
    """'http://127.0.0.1:8000' | 'grpc://localhost:8001' | '127.0.0.1:8000' -> (protocol, 'host:port');
    only loopback hosts are accepted (this tool never sends traffic elsewhere)."""
    u = urllib.parse.urlsplit(url if "://" in url else f"{protocol}://{url}")
    if u.scheme not in PROTOCOLS:
        raise XDeployError(f"loadtest URL scheme must be http:// or grpc://, got {url!r}")
    if u.hostname not in LOOPBACK:
        raise XDeployError(f"loadtest only sends traffic to loopback (127.0.0.1, localhost); got host {u.hostname!r}")
    try:
        port = u.port
    except ValueError:
        port = None
    if port is None:
        raise XDeployError(f"loadtest URL needs a port, e.g. http://127.0.0.1:8000; got {url!r}")
    host = "127.0.0.1" if u.hostname == "localhost" else u.hostname
    return u.scheme, f"{host}:{port}"


def _client(protocol: str, target: str, timeout: float) -> tuple[Any, Any]:
    if protocol == "grpc":
        import tritonclient.grpc as m

        return m, m.InferenceServerClient(target)
    import tritonclient.http as m

    return m, m.InferenceServerClient(target, connection_timeout=timeout, network_timeout=timeout)


def _request(mod: Any, client: Any, model: str, texts: Sequence[str], timeout: float) -> np.ndarray:
    inp = mod.InferInput("TEXT", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    kw = {"client_timeout": timeout} if mod.__name__.endswith("grpc") else {}
    return client.infer(model, [inp], **kw).as_numpy("EMBEDDING")


def run_level(protocol: str, target: str, o: LoadOptions, concurrency: int, texts: Sequence[str]
              ) -> dict[str, Any]:
    """One concurrency level; returns the measured fields (latencies in seconds)."""
    lock = threading.Lock()
    sent = [0]
    lat_ok: list[float] = []
    lat_err: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + o.time_limit

    def worker() -> None:
        mod, client = _client(protocol, target, o.timeout)
        try:
            while time.monotonic() < deadline:
                with lock:
                    if sent[0] >= o.requests:
                        return
                    k = sent[0]
                    sent[0] += 1
                batch = [texts[(k * o.batch + j) % len(texts)] for j in range(o.batch)]
                t0 = time.perf_counter()
                try:
                    out = _request(mod, client, o.model, batch, o.timeout)
                    ok = out.shape[0] == len(batch)
                    err = "" if ok else f"got {out.shape[0]} vectors for {len(batch)} sentences"
                except Exception as e:  # tritonclient raises its own exception types; counted, never fatal
                    ok, err = False, str(e).splitlines()[0][:200]
                dt = time.perf_counter() - t0
                with lock:
                    (lat_ok if ok else lat_err).append(dt)
                    if not ok:
                        errors.append(err)
        finally:
            client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(o.time_limit + o.timeout + 5)  # a request in flight at the deadline may still finish
    wall = time.perf_counter() - t0
    return {"ok": len(lat_ok), "errors": len(lat_err), "wall_s": wall, "latencies": lat_ok or lat_err,
            "error_examples": sorted(set(errors))[:3], "hit_time_limit": sent[0] < o.requests}


def loadtest(target: str | Path, options: LoadOptions | None = None, *, log: str | Path | None = None
             ) -> list[dict[str, Any]]:
    """Load-test a running server (URL) or an artifact (a server is started on free loopback ports and stopped).
    Returns one validated `loadtest` record per concurrency level."""
    o = options or LoadOptions()
    if o.protocol not in PROTOCOLS:
        raise XDeployError(f"unknown protocol {o.protocol!r}; expected one of: {', '.join(PROTOCOLS)}")
    if not o.concurrency or any(not 1 <= c <= 256 for c in o.concurrency):
        raise XDeployError(f"concurrency levels must be 1..256, got {list(o.concurrency)}")
    if o.requests < 1 or not o.time_limit > 0 or o.batch < 1 or o.warmup < 0:
        raise XDeployError("need requests >= 1, time_limit > 0, batch >= 1 and warmup >= 0")
    t = str(target)
    if "://" in t or (not Path(t).exists() and ":" in t):
        return _run(*parse_target(t, o.protocol), o, server=None)
    base = [_baseline(t, o)] if o.baseline else []  # before the server starts: the two never compete for cores
    srv_opts = ServeOptions(http_port=0, grpc_port=0, model_name=o.model)
    with ServerProcess(t, srv_opts, log=log) as srv:
        return base + _run(o.protocol, srv.http_url if o.protocol == "http" else srv.grpc_url, o, server=srv)


def _baseline(artifact: str, o: LoadOptions) -> dict[str, Any]:
    """The same request stream, one at a time, on an in-process Embedder: what the server adds is the difference."""
    from xdeploy.bench.latency import summarize
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record
    from xdeploy.deploy.embedder import Embedder

    texts = corpus(512)
    lat: list[float] = []
    with Embedder(artifact) as emb:
        for k in range(o.warmup):
            emb.embed(texts[k * o.batch:(k + 1) * o.batch])
        deadline = time.monotonic() + o.time_limit
        t0 = time.perf_counter()
        for k in range(o.requests):
            if time.monotonic() >= deadline:
                break
            batch = [texts[(k * o.batch + j) % len(texts)] for j in range(o.batch)]
            t1 = time.perf_counter()
            emb.embed(batch)
            lat.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
    st = summarize(lat)
    return make_record("loadtest", fingerprint(), note="baseline: in-process Embedder (ort), no server, sequential"
                       + ("; stopped at the time limit" if len(lat) < o.requests else ""),
                       target=str(artifact), server="in-process Embedder", model=o.model, protocol="none",
                       concurrency=1, batch=o.batch, requests=len(lat), errors=0, sentences=len(lat) * o.batch,
                       timed_s=wall, requests_per_s=len(lat) / wall, sentences_per_s=len(lat) * o.batch / wall,
                       latency_s={k: getattr(st, k) for k in ("p50", "p90", "p99", "mean", "std", "min", "max")})


def _ready_models(protocol: str, client: Any) -> list[str]:
    """Names of the models the server has READY (for the error that says which name to call)."""
    try:
        index = client.get_model_repository_index(**({"as_json": True} if protocol == "grpc" else {}))
    except Exception:  # an old or partial server: the error still names the model asked for
        return []
    models = index.get("models", []) if isinstance(index, dict) else index
    return sorted(m["name"] for m in models if m.get("state", "READY") == "READY")


def _run(protocol: str, target: str, o: LoadOptions, server: ServerProcess | None) -> list[dict[str, Any]]:
    from xdeploy.bench.latency import summarize
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record

    texts = corpus(512)
    mod, client = _client(protocol, target, o.timeout)
    try:
        if not client.is_model_ready(o.model):
            served = _ready_models(protocol, client)
            raise XDeployError(f"model {o.model!r} is not ready on {protocol}://{target}; it serves: "
                               f"{', '.join(served) or 'no ready model'} (pass --model-name NAME)")
        for k in range(o.warmup):
            _request(mod, client, o.model, texts[k * o.batch:(k + 1) * o.batch], o.timeout)
    except XDeployError:
        raise
    except Exception as e:  # connection refused, unknown model, ...
        raise XDeployError(f"cannot use {protocol}://{target} model {o.model!r}: {str(e).splitlines()[0]}") from None
    finally:
        client.close()
    fp = fingerprint()
    records = []
    for c in o.concurrency:
        r = run_level(protocol, target, o, c, texts)
        stats = summarize(r["latencies"]) if r["latencies"] else None
        note = None
        if r["errors"]:
            note = f"{r['errors']} errors, e.g. {r['error_examples'][0]}"
            if not r["ok"]:
                note += "; all requests failed: latency_s is of the error responses"
        if stats is None:
            note = "no request completed"
        if r["hit_time_limit"]:
            note = (note + "; " if note else "") + f"stopped at the {o.time_limit:g} s time limit"
        records.append(make_record(
            "loadtest", fp, note=note, target=f"{protocol}://{target}",
            server="xdeploy serve (PyTriton)" if server else "external", model=o.model, protocol=protocol,
            concurrency=c, batch=o.batch, requests=r["ok"] + r["errors"], errors=r["errors"],
            sentences=r["ok"] * o.batch, timed_s=r["wall_s"],
            requests_per_s=r["ok"] / r["wall_s"], sentences_per_s=r["ok"] * o.batch / r["wall_s"],
            latency_s={k: getattr(stats, k) for k in ("p50", "p90", "p99", "mean", "std", "min", "max")}
            if stats else {k: 0.0 for k in ("p50", "p90", "p99", "mean", "std", "min", "max")}))
    return records
