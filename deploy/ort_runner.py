"""ONNX Runtime on the CPU execution provider."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from xdeploy.errors import XDeployError

from .base import Runner, RunnerInfo, validate_feeds

OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}


def session_options(threads: int = 0, opt_level: str = "all") -> Any:
    import onnxruntime as ort

    if opt_level not in OPT_LEVELS:
        raise XDeployError(f"unknown optimization level {opt_level!r}; expected one of: {', '.join(OPT_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[opt_level])
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


class OrtRunner(Runner):
    name = "ort"
    providers: tuple[Any, ...] = ("CPUExecutionProvider",)

    def _load(self) -> None:
        import onnxruntime as ort

        so = session_options(self.threads, self.options.get("opt_level", "all"))
        try:
            self.session = ort.InferenceSession(str(self.artifact.onnx_path(self.graph.name)), so,
                                                providers=list(self._providers()))
        except Exception as e:  # onnxruntime raises its own exception types for bad models
            raise XDeployError(f"onnxruntime cannot load {self.artifact.onnx_path(self.graph.name)}: "
                               f"{str(e).splitlines()[0]}") from None

    def _providers(self) -> tuple[Any, ...]:
        return self.providers

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, outs))

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """IO binding: inputs bound once in place (no copy per call), outputs allocated by the session."""
        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        binding = self.session.io_binding()
        for name, a in checked.items():
            binding.bind_cpu_input(name, a)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        run = self.session.run_with_iobinding
        return lambda: run(binding)

    def info(self) -> RunnerInfo:
        import onnxruntime as ort

        so = self.session.get_session_options()
        return RunnerInfo(runner=self.name, device="cpu", precision=self.artifact.precision,
                          threads=so.intra_op_num_threads or _cores(),
                          versions={"onnxruntime": ort.__version__})

    def close(self) -> None:
        self.__dict__.pop("session", None)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))
