"""OpenVINO on the CPU: compile the artifact's graph (its OpenVINO IR when it carries one, else the ONNX graph)
with a precision hint.

    open_runner("ov", art)                                   # f32 compute
    open_runner("ov:bf16", art, threads=2, hint="latency",   # bf16 compute (AVX-512 BF16 / AMX CPUs)
                cache_dir="~/.cache/xdeploy/ov")             # compiled-model blobs reused across processes

An fp32 artifact exported with `--openvino-ir` carries openvino/<graph>.xml converted from the reference module
(export/openvino_ir.py: fewer layout ops once compiled); option `format` picks: "auto" (the IR when present),
"onnx", "ir". Compile options come from sessions.py (`ov_config`). Variants set INFERENCE_PRECISION_HINT ("" and "f32"
-> f32, "bf16" -> bf16). Weights stay as stored in the ONNX file (fp32, fp16 or int8 Q/DQ); the hint is the
precision the CPU plugin computes in. Dynamic axes stay dynamic: the ONNX frontend keeps them and each call
may use any shape inside the exported range.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.deps import import_quietly, installed
from xdeploy.core.errors import XDeployError, one_of

from .base import Runner, RunnerInfo, validate_feeds
from .sessions import OV_PRECISION_HINTS, onnx_file, ov_compile, ov_config

_OV_TO_NAME = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
GRAPH_FORMATS = ("auto", "onnx", "ir")  # auto: the artifact's OpenVINO IR when it carries one


class OvRunner(Runner):
    name = "ov"
    variants = tuple(OV_PRECISION_HINTS)
    reads_openvino_ir = True
    # the hints other than the default's (f32) compute in their own precision: ov:bf16 -> "bf16"
    variant_precisions = {v: _OV_TO_NAME[h] for v, h in OV_PRECISION_HINTS.items() if h != OV_PRECISION_HINTS[""]}
    layerwise = True

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        return [] if installed("openvino") else ["the openvino package is not installed (pip install "
                                                 "'xdeploy[openvino]')"]

    @classmethod
    def probe(cls, model: Any, names: list[str], variant: str = "", *, providers: Sequence[Any] = (),
              opt_level: str = "all") -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        """The OpenVINO CPU plugin on the same ONNX graph (read from a temporary file), compiled with the runner's
        own options for `variant` (precision hint, latency hint)."""
        ov = import_quietly("openvino")

        with onnx_file(model) as path:
            read = ov.Core().read_model(str(path))
        compiled = ov_compile(read, ov_config(variant), what="the graph with exposed tensors")

        def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            res = compiled(dict(feeds))
            by_name = {n: res[o] for o in compiled.outputs for n in o.get_names()}
            return {n: np.asarray(by_name[n]) for n in names}

        return run

    def _load(self) -> None:
        try:
            ov = import_quietly("openvino")
        except ImportError:
            raise XDeployError("runner 'ov' needs the openvino package: pip install 'xdeploy[openvino]'") from None
        self._ov = ov
        unknown = set(self.options) - {"hint", "cache_dir", "device", "format", "pinning"}
        if unknown:
            raise XDeployError(f"unknown ov option(s) {sorted(unknown)}; expected hint, cache_dir, device, format, "
                               "pinning")
        fmt = self.options.get("format", "auto")
        if fmt not in GRAPH_FORMATS:
            raise one_of("ov graph format", fmt, GRAPH_FORMATS)
        config = ov_config(self.variant, hint=self.options.get("hint", "latency"), threads=self.threads,
                           cache_dir=self.options.get("cache_dir"), pinning=self.options.get("pinning"))
        self.device = str(self.options.get("device", "CPU"))
        # The artifact's OpenVINO IR (converted from the reference module: fewer layout ops once compiled,
        # export/openvino_ir.py) when it has one, else the ONNX graph; format="onnx" / "ir" forces one.
        ir = self.artifact.openvino_ir(self.graph.name)
        if fmt == "ir" and ir is None:
            raise XDeployError(f"artifact {self.artifact.path} carries no OpenVINO IR for graph {self.graph.name!r}; "
                               "export it with --openvino-ir (fp32) or use format='onnx'")
        path = ir if ir is not None and fmt != "onnx" else self.artifact.onnx_path(self.graph.name)
        self.graph_format = "ir" if path == ir else "onnx"
        # Compiling from the path (not a read_model result) lets the cache skip reading the ONNX file
        # entirely when a blob for this model + config exists; with an `outputs` subset the unused results
        # are removed first, so the plugin prunes the branches that only fed them.
        self.compiled = ov_compile(self._pruned(path) if len(self.output_names) < len(self.graph.outputs)
                                   else path, config, self.device, what=str(path))
        # One infer request per thread: an OpenVINO request is not re-entrant ("Infer Request is busy"),
        # while the compiled model is thread-safe and shares its weights between requests.
        self._local = threading.local()
        # A port can carry several tensor names (an fp16 graph's keep-io Cast adds one); index them all.
        self._in_ports = {n: p for p in self.compiled.inputs for n in p.get_names()}
        self._out_ports = {n: p for p in self.compiled.outputs for n in p.get_names()}
        missing = [t.name for t in self.graph.inputs if t.name not in self._in_ports] + \
                  [n for n in self.output_names if n not in self._out_ports]
        if missing:
            raise XDeployError(f"{path} does not match its manifest: OpenVINO finds no tensor(s) {missing}")

    def _pruned(self, path: Path) -> Any:
        """The graph read from `path` with only the results named in `output_names`."""
        try:
            model = self._ov.Core().read_model(str(path))
        except Exception as e:
            raise XDeployError(f"OpenVINO cannot read {path}: {str(e).strip().splitlines()[0]}") from None
        keep = set(self.output_names)
        for res in list(model.get_results()):
            if not keep & set(res.output(0).get_names() | res.input_value(0).get_names()):
                model.remove_result(res)
        return model

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # share_inputs: OpenVINO reads the (validated, contiguous) arrays in place; outputs are copied out
        # because the request reuses its output memory on the next call.
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        res = req.infer(feeds, share_inputs=True)
        return {n: np.array(res[self._out_ports[n]], copy=True) for n in self.output_names}

    def _request_on(self, arrays: Mapping[str, np.ndarray]) -> Any:
        """A new infer request whose input tensors share the arrays' memory. Each prepared/bound call owns
        its request, so a later `infer()` (which sets its own inputs) never re-points a bound call."""
        req = self.compiled.create_infer_request()
        for name, a in arrays.items():
            req.set_tensor(self._in_ports[name], self._ov.Tensor(a, shared_memory=True))
        return req

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """Inputs set once as tensors sharing the arrays' memory; each call only runs the model."""
        req = self._request_on(validate_feeds(self.graph, self.artifact.spec.axes, feeds))
        return lambda: req.infer(None, share_outputs=True)

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """Truly zero-copy: input and output ov.Tensors wrap the caller's numpy buffers (shared_memory=True),
        so each call reads the current input contents and the CPU plugin writes results straight into the
        output arrays. Output arrays must have the exact shape the inputs imply (dims from the manifest)."""
        checked = self.check_bound(inputs, outputs)  # outputs: among those this runner computes (outputs=)
        sizes = _axis_sizes(self.graph, checked)
        declared = {t.name: t for t in self.graph.outputs}
        for name, buf in outputs.items():
            t = declared[name]
            if any(isinstance(d, str) and d not in sizes for d in t.dims):
                raise XDeployError(f"output {name!r} has an axis no input binds; it cannot be bound")
            shape = tuple(d if isinstance(d, int) else sizes[d] for d in t.dims)
            if not isinstance(buf, np.ndarray) or buf.dtype != np.dtype(t.dtype) or buf.shape != shape \
                    or not buf.flags.c_contiguous or not buf.flags.writeable:
                raise XDeployError(f"bound output {name!r} must be a writeable C-contiguous {t.dtype} array of "
                                   f"shape {shape}")
        req = self._request_on(checked)
        for name, buf in outputs.items():
            req.set_tensor(self._out_ports[name], self._ov.Tensor(buf, shared_memory=True))
        keep = (checked, dict(outputs))  # the tensors alias these arrays: keep them alive with the call

        def call() -> None:
            _ = keep
            req.infer(None, share_outputs=True)

        return call

    def info(self) -> RunnerInfo:
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()  # ov.Type -> "bf16"
        compute = "int8" if self.artifact.precision == "int8" else _OV_TO_NAME.get(hint, hint)
        full_name = self._ov.Core().get_property(self.device, "FULL_DEVICE_NAME")
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""),
                          device=f"{self.device.lower()} ({full_name})",
                          precision=compute, threads=int(self.compiled.get_property("INFERENCE_NUM_THREADS")),
                          versions={"openvino": self._ov.get_version()})

    def close(self) -> None:
        # the infer requests live in per-thread slots of `_local`: a fresh one drops every thread's request
        self._local = threading.local()
        self.__dict__.pop("compiled", None)


def _axis_sizes(graph: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Axis name -> size as bound by the (validated) inputs."""
    sizes: dict[str, int] = {}
    for t in graph.inputs:
        for d, n in zip(t.dims, feeds[t.name].shape):
            if isinstance(d, str):
                sizes[d] = int(n)
    return sizes
