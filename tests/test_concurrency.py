"""Every CPU runner used from 8 threads for 1,000 requests gives exactly the single-threaded results."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from xdeploy.deploy.registry import RUNNERS, open_runner
from xdeploy.models.spec import make_feeds

CPU_RUNNERS = [r for r in ("torch", "ort", "ov") if r in RUNNERS]
N_REQUESTS, N_THREADS = 1000, 8


@pytest.fixture(scope="module")
def art(tiny_export):
    return tiny_export("bert")


@pytest.mark.parametrize("runner", CPU_RUNNERS)
def test_runner_is_thread_safe(art, runner):
    with open_runner(runner, art) as r:
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


@pytest.mark.parametrize("sessions", ["shared", "per-thread"])
def test_embedder_is_thread_safe(tmp_path_factory, sessions):
    from tiny_text import tiny_text_artifact

    from xdeploy.deploy.embedder import Embedder

    art = tiny_text_artifact(tmp_path_factory.getbasetemp())
    texts = [f"request {i}: " + "word " * (i % 23) for i in range(40)]
    with Embedder(art, sessions=sessions) as emb:
        expected = [emb.embed([t]) for t in texts]  # single-threaded, one sentence per call

        def one(i: int) -> bool:
            return bool(np.array_equal(emb.embed([texts[i % len(texts)]]), expected[i % len(texts)]))

        with ThreadPoolExecutor(N_THREADS) as pool:
            results = list(pool.map(one, range(N_REQUESTS)))
    assert all(results), f"{results.count(False)} of {N_REQUESTS} concurrent embeddings differ"
