"""Runners declare their capabilities, and nothing else keeps a list of runner names.

The proof (as tests/test_capabilities.py's fifth model family is for models): a runner the library has never seen,
defined and registered here with one registry line, is listed by `xdeploy doctor`, offered to verify/layerwise.py
and goes through the runner contract of tests/runners.py (the torch reference on every graph, outputs=, bind,
thread safety, layerwise bisection) with no library change."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from planted import corrupt_weight
from runners import (
    check_bind_with_pruned_outputs,
    check_outputs_option,
    check_thread_safe,
    params,
    reference_failures,
)

from xdeploy.deploy import registry
from xdeploy.deploy.base import Runner, RunnerInfo
from xdeploy.deploy.ort_runner import OrtRunner
from xdeploy.deploy.sessions import ort_session
from xdeploy.export.artifact import load_artifact
from xdeploy.models.spec import DEFAULT_TOLERANCES, Tolerance, make_feeds
from xdeploy.verify.layerwise import find_divergence, runtimes

SIZES = {"batch": 2, "seq": 5}


def _bf16(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float outputs rounded to bf16 (nearest, kept as float32): what a bf16 compute path returns at the end."""
    def one(a: np.ndarray) -> np.ndarray:
        if a.dtype != np.float32:
            return a
        bits = (a.view(np.uint32).astype(np.uint64) + 0x8000) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)

    return {k: one(v) for k, v in outputs.items()}


class EchoRunner(Runner):
    """onnxruntime under another name; its "bf16" variant rounds every float output to bf16."""

    name = "echo"
    variants = ("", "bf16")
    variant_precisions = {"bf16": "bf16"}
    layerwise = True

    def _load(self) -> None:
        self.session = ort_session(self.artifact.onnx_path(self.graph.name), threads=self.threads)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        return _bf16(out) if self.variant else out

    def info(self) -> RunnerInfo:
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""), device="cpu",
                          precision=self.variant or self.artifact.precision, threads=self.threads)

    @classmethod
    def probe(cls, model: Any, names: list[str], variant: str = "", *, providers: Sequence[Any] = (),
              opt_level: str = "all") -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        call = OrtRunner.probe(model, names, providers=providers, opt_level=opt_level)
        return (lambda feeds: _bf16(call(feeds))) if variant else call


@pytest.fixture
def echo(monkeypatch):
    """The one registry line, for this test only."""
    monkeypatch.setitem(registry.RUNNERS, EchoRunner.name, f"{__name__}:{EchoRunner.__name__}")
    return EchoRunner.name


@pytest.fixture(scope="module")
def bert(tiny_export):
    return {p: load_artifact(tiny_export("bert", precision=p)) for p in ("fp32", "fp16")}


def test_the_registry_lists_a_registered_runner_everywhere(echo, capsys):
    from xdeploy.cli import main
    from xdeploy.commands.doctor import runner_gaps

    for caps in ({}, {"runs_graph": True}, {"layerwise": True}):
        assert {"echo", "echo:bf16"} <= set(registry.specs(**caps))
        assert {"echo", "echo:bf16"} <= {p.id for p in params(**caps)}  # what the contract tests run over
    assert "echo:bf16" not in {p.id for p in params(variants=False)}
    assert registry.compute_precision("echo:bf16") == "bf16" and registry.compute_precision("echo") is None
    assert not registry.needs_gpu("echo") and registry.gaps("echo:bf16") == []
    assert {"echo", "echo:bf16"} <= set(runtimes())
    assert runner_gaps()["echo"] == []
    assert main(["doctor"]) == 0
    assert "echo      ok" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("spec", ["echo", "echo:bf16"])
def test_a_registered_runner_is_contract_tested(echo, bert, spec):
    fp32 = bert["fp32"]
    cache: dict[str, tuple[dict, dict]] = {}

    def reference(graph: str) -> tuple[dict, dict]:
        if graph not in cache:
            feeds = make_feeds(fp32.graph(graph), SIZES, seed=7)
            with registry.open_runner("torch", fp32, graph) as t:
                cache[graph] = feeds, t.infer(feeds)
        return cache[graph]

    for art in bert.values():
        assert reference_failures(spec, art, reference) == []
    check_outputs_option(spec, fp32, *reference("model"))
    check_bind_with_pruned_outputs(spec, fp32)
    check_thread_safe(spec, fp32)


def test_a_registered_runner_is_a_layerwise_runtime(echo, bert):
    ref = onnx.load(str(bert["fp32"].onnx_path()))
    feeds = make_feeds(bert["fp32"].graph(), {"batch": 3, "seq": 16}, seed=1)
    bad = copy.deepcopy(ref)
    consumer = corrupt_weight(bad, "model.layers.1.ffn.fc2.bias", delta=5.0)
    d = find_divergence(ref, bad, feeds, DEFAULT_TOLERANCES["fp32"], candidate_runtime="echo")
    assert d is not None and d.node == consumer, d
    # the variant's own compute (bf16-rounded tensors) is what the candidate runs: within bf16 tolerance, and
    # out of an exact one
    assert find_divergence(ref, ref, feeds, DEFAULT_TOLERANCES["bf16"], candidate_runtime="echo:bf16") is None
    assert find_divergence(ref, ref, feeds, Tolerance(0.0, 0.0, 1.0 + 1e-12),
                           candidate_runtime="echo:bf16") is not None
