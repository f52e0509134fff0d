"""Every registered runner used from 8 threads for 1,000 requests gives exactly the single-threaded results
(tests/runners.py: the registry's runners, each skipped by what this machine lacks to open it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from runners import N_REQUESTS, N_THREADS, check_thread_safe, params, require


@pytest.fixture(scope="module")
def art(tiny_export):
    return tiny_export("bert")


@pytest.mark.parametrize("runner", params(variants=False))
def test_runner_is_thread_safe(art, runner):
    require(runner)
    check_thread_safe(runner, art)


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
