"""Tests parametrize over the runner registry, never over a list of names (as tests/families.py does for models),
and run the runner contract as functions of a spec, so that a runner registered by a test
(tests/test_runner_contract.py) goes through the same checks as the registered ones.

A spec needing a GPU is marked `gpu`; a spec this machine cannot open is skipped with what it lacks
(deploy/registry.gaps), never by its name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.metrics import cosine
from xdeploy.deploy.registry import RUNNERS, compute_precision, gaps, needs_gpu, open_runner, specs
from xdeploy.models.spec import DEFAULT_TOLERANCES, Tolerance, make_feeds

N_REQUESTS, N_THREADS = 1000, 8


def params(*, variants: bool = True, cpu_only: bool = False, **caps: Any) -> list[Any]:
    """pytest params over the registry's distinct specs with the given capabilities (`registry.specs`); without
    `variants` only each runner's default; with `cpu_only` none needing a GPU. GPU specs are marked `gpu`."""
    found = specs(**caps) if variants else [n for n in RUNNERS if n in specs(**caps)]
    return [pytest.param(s, marks=[pytest.mark.gpu] if needs_gpu(s) else [], id=s) for s in found
            if not (cpu_only and needs_gpu(s))]


def require(spec: str) -> None:
    """Skip unless this machine can open `spec`, saying what it lacks."""
    missing = gaps(spec)
    if missing:
        pytest.skip(f"{spec} cannot open here: {'; '.join(missing)}")


def tolerance(spec: str, precision: str) -> Tolerance:
    """What `spec` on an artifact of `precision` is held to: the looser of the artifact's tolerance and that of
    the precision the spec computes in (a bf16 runner on an fp16 artifact: the looser of the two)."""
    tols = [DEFAULT_TOLERANCES[p] for p in {precision, compute_precision(spec) or precision}]
    return min(tols, key=lambda t: t.cosine)


def close(ref: np.ndarray, got: np.ndarray, tol: Tolerance, *, cosine_only: bool) -> tuple[bool, str]:
    """The manifest criterion: elementwise within atol + rtol*|ref|, or cosine similarity >= tol.cosine.
    Reduced precisions are judged on direction only (cosine), fp32 on values first."""
    assert got.shape == ref.shape and np.isfinite(got).all()
    a, b = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    cos = cosine(a, b)
    err = float(np.max(np.abs(a - b) - tol.rtol * np.abs(a))) if a.size else 0.0
    ok = cos >= tol.cosine if cosine_only else (err <= tol.atol or cos >= tol.cosine)
    return ok, f"cosine {cos:.6f} (need {tol.cosine}), max excess error {err:.3g} (atol {tol.atol})"


def reference_failures(spec: str, art: Any, reference: Callable[[str], tuple[dict, dict]]) -> list[str]:
    """`spec` on every graph of `art` against the torch fp32 reference (`reference(graph)` -> feeds, outputs):
    one line per output out of tolerance."""
    failures = []
    for graph in art.spec.graphs:
        feeds, ref = reference(graph.name)
        tol = tolerance(spec, art.precision)
        with open_runner(spec, art, graph.name, threads=2) as r:
            got = r.infer({k: v.copy() for k, v in feeds.items()})
        assert set(got) == set(ref)
        for name in ref:
            ok, why = close(ref[name], got[name], tol, cosine_only=tol is not DEFAULT_TOLERANCES["fp32"])
            if not ok:
                failures.append(f"{spec} {art.model}/{graph.name}/{name} @ {art.precision}: {why}")
    return failures


def check_outputs_option(spec: str, art: Any, feeds: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]
                         ) -> None:
    """outputs=[name]: only that output comes back (every call path), equal to the full run's; OpenVINO compiles
    a model without the other results (BERT's pooler branch pruned); a wrong name is one clean error."""
    names = [t.name for t in art.graph("model").outputs]
    assert len(names) >= 2
    first = names[0]
    with open_runner(spec, art, threads=1, outputs=[first]) as r:
        assert r.output_names == [first]
        got = r.infer(feeds)
        assert list(got) == [first]
        compute = compute_precision(spec)
        ok, why = close(ref[first], got[first], tolerance(spec, "fp32"), cosine_only=compute is not None)
        assert ok, why
        compiled = getattr(r, "compiled", None)  # an OpenVINO compiled model (the ov runner)
        if compiled is not None:
            assert [n for p in compiled.outputs for n in p.get_names()] == [first]
    with pytest.raises(XDeployError, match=r"unknown output\(s\) \['nope'\]"):
        open_runner(spec, art, threads=1, outputs=["nope"])


def check_bind_with_pruned_outputs(spec: str, art: Any) -> None:
    """A runner opened with outputs= binds only those: a graph output it does not compute is refused in one line,
    a requested one binds and is written in place (BERT: last_hidden_state requested, pooler_output not)."""
    feeds = make_feeds(art.graph(), {"batch": 1, "seq": 4})
    with open_runner(spec, art, outputs=["last_hidden_state"]) as r:
        want = r.infer(feeds)["last_hidden_state"]  # [1, 4, d]
        with pytest.raises(XDeployError, match=r"unknown output\(s\) \['pooler_output'\]"):
            r.bind(feeds, {"pooler_output": np.zeros((1, want.shape[-1]), np.float32)})
        hidden = np.zeros_like(want)
        r.bind(feeds, {"last_hidden_state": hidden})()
        np.testing.assert_allclose(hidden, want, atol=1e-5)


def check_bind_reads_current_inputs(spec: str, art: Any, graph: str, sizes: Mapping[str, int],
                                    **options: Any) -> Any:
    """The bind contract the KV-cache loop relies on: each bound call reads what the caller's input arrays hold
    *now* (the loop writes the next token and the cache in place between steps) and writes the caller's output
    buffers. Two different requests of one shape through one binding give what infer() gives for each. Returns
    the (closed) runner, for checks of its own state."""
    first, second = (make_feeds(art.graph(graph), sizes, seed=s) for s in (1, 2))
    with open_runner(spec, art, graph, threads=1, **options) as r:
        want = [r.infer(first), r.infer(second)]
        assert any(not np.array_equal(want[0][k], want[1][k]) for k in want[0])  # the inputs make a difference
        inputs = {k: v.copy() for k, v in first.items()}
        outputs = {k: np.zeros_like(v) for k, v in want[0].items()}
        call = r.bind(inputs, outputs)
        for i, request in enumerate((first, second, first)):
            for k, v in request.items():
                np.copyto(inputs[k], v)  # in place, as the decoding loop does
            call()
            for k, buf in outputs.items():
                np.testing.assert_allclose(buf, want[i % 2][k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{spec}: bound call {i + 1} did not read the current inputs ({k})")
    return r


def check_thread_safe(spec: str, art: Any) -> None:
    """One runner used from 8 threads for 1,000 requests gives exactly the single-threaded results."""
    with open_runner(spec, art) as r:
        # 16 distinct requests of different shapes, each issued many times from 8 threads at once.
        requests = [make_feeds(r.graph, {"batch": 1 + i % 3, "seq": 3 + 5 * i}, seed=i) for i in range(16)]
        expected = [r.infer(f) for f in requests]

        def one(i: int) -> bool:
            got = r.infer(requests[i % len(requests)])
            want = expected[i % len(requests)]
            return all(np.array_equal(got[k], want[k]) for k in want)

        with ThreadPoolExecutor(N_THREADS) as pool:
            results = list(pool.map(one, range(N_REQUESTS)))
    assert all(results), f"{results.count(False)} of {N_REQUESTS} concurrent results differ"
