"""ONNX Runtime on the CPU execution provider (session options: sessions.py).

    open_runner("ort", art, "decode", stateful=True)    # the KV cache kept inside the engine (deploy/ort_cache.py)

Option `stateful` opens, in place of a decoder's decode graph, that graph with each layer's attention rewritten
to onnxruntime's GroupQueryAttention, which appends to the cache in place; the decoding loop drives it through
`cached_step()`, and `infer` still takes the decode graph's feeds and returns its outputs, so golden probes and
parity check the rewritten graph as the decode graph.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from xdeploy.core.errors import XDeployError, ort_reason
from xdeploy.core.fingerprint import usable_cpus
from xdeploy.export.onnx_graph import TWO_GB, proto_size

from .base import CachedStep, Runner, RunnerInfo, is_tensor, numpy_dtype, validate_feeds
from .saturation_guard import refuse_saturating_int8
from .sessions import (
    CPU_PROVIDERS,
    ORT_CPU_SLOW_FUSIONS,
    one_thread_steps,
    onnx_file,
    ort_session,
    ort_session_options,
)

# the CPU runner's options (a GPU runner's own: ort_gpu_runner.py OPTIONS)
OPTIONS = ("opt_level", "spinning", "spin_between_runs", "stateful", "signed_prefill", "allow_saturation",
           "fuse_skip_layer_norm")


class OrtRunner(Runner):
    name = "ort"
    providers: tuple[Any, ...] = CPU_PROVIDERS
    # Interleaved with other engines, onnxruntime's intra-op pool spinning after a call (its default) slows the
    # block timed next: on 2 cores (MiniLM, 12 rotated rounds) 25-38% of the rounds after an ort block were >10%
    # slow and the paired intervals of the batch-1 speed-ups were +-16-26% wide (studies/round_noise.py,
    # docs/benchmarks.md). session.force_spinning_stop keeps the pool spinning while a Run() lasts (between the
    # ops of one call, where a parked thread costs a wake-up per op) and stops it the moment the call returns:
    # the same +-4-7% intervals as no spinning at all, without its cost to onnxruntime itself (batch 1: 1-5% on
    # MiniLM, ~7% per decode step on GPT-2 small). The record's stability block names the options. Since the harness
    # also waits for the process's threads to go idle before each block (bench/interleave.py wait_idle), onnxruntime's
    # default would be fair too; the two cost the candidate the same (within +-1.2%, MiniLM b1/b8 fp32 and int8, Zen 4,
    # docs/benchmarks.md), and with this option that wait returns in ~3 ms instead of outlasting a ~40 ms spin.
    interleaved_options: ClassVar[Mapping[str, Any]] = {"spin_between_runs": False}
    layerwise = True
    stateful = False
    prefill_session: Any = None  # stateful, int8-dynamic, signed_prefill=True on AMX: the int8-weight session for
    # prompts; stateful on a small decoder (sessions one_thread_steps): the session with the runner's threads,
    # `session` then running the steps on one thread
    signed: bool = False  # whether int8 weights are in use (_int8_weights_route; on VNNI without AMX by default)
    fuses_cache: ClassVar[bool] = True  # `stateful`: the decode graph rewritten to keep the cache (CPU only)
    # onnxruntime optimizers left out (sessions.py ORT_CPU_SLOW_FUSIONS: slower on the CPU provider); option
    # fuse_skip_layer_norm=True keeps onnxruntime's SkipLayerNormFusion, for comparison
    slow_fusions: ClassVar[tuple[str, ...]] = ORT_CPU_SLOW_FUSIONS
    # Whether a bound numpy input is read in place by every run. True on the CPU provider only: onnxruntime copies
    # an input bound on the host to the device of the node that reads it *when it is bound* (IOBinding::BindInput ->
    # CopyOneInputAcrossDevices, onnxruntime/core/session/IOBinding.cc), so on a GPU provider a binding made once
    # keeps the first call's inputs: the decoding loop's steps then all read the first step's token and cache
    # (ort-cuda agreed with PyTorch on 1 of 16 greedy tokens, NVIDIA H200, 2026-11-30). Where False, every bound
    # call binds its inputs again (the host->device copy session.run makes too).
    binds_in_place: ClassVar[bool] = True
    run_options: Any = None  # onnxruntime RunOptions of every unbound run (a GPU runner's CUDA graphs: none captured)

    @classmethod
    def keeps_cache(cls, artifact: Any, graph: str) -> bool:
        from .ort_cache import fused_graph

        return cls.fuses_cache and fused_graph(artifact, graph)[1] > 0

    @classmethod
    def probe(cls, model: Any, names: list[str], variant: str = "", *, providers: Sequence[Any] = (),
              opt_level: str = "all") -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        """One session on the in-memory model (serialized, or a temporary file beyond protobuf's 2 GB)."""
        so, what = ort_session_options(0, opt_level, disabled_optimizers=cls.slow_fusions), \
            "the graph with exposed tensors"
        providers = list(providers) or list(CPU_PROVIDERS)
        if proto_size(model) < TWO_GB:
            sess = ort_session(model.SerializeToString(), options=so, providers=providers, what=what)
        else:
            with onnx_file(model) as path:
                sess = ort_session(path, options=so, providers=providers, what=what)
        return lambda feeds: dict(zip(names, sess.run(names, dict(feeds))))

    def _load(self) -> None:
        if self.name == "ort" and not self.options.pop("allow_saturation", False):
            refuse_saturating_int8(self.artifact, self.graph.name, runtime="onnxruntime")
        self._check_options()
        self.stateful = bool(self.options.get("stateful", False))
        if self.stateful:
            self._load_fused()
            return
        self.session = ort_session(self.artifact.onnx_path(self.graph.name), providers=self._providers(),
                                   options=self._session_options(self.threads))

    def _session_options(self, threads: int, weights: Any = None) -> Any:
        """The runner's session options with `threads`; `weights`: the folder of the external-data file a graph
        given as bytes reads its weights from (the rewritten decode graph)."""
        spinning, between = self.options.get("spinning"), self.options.get("spin_between_runs")
        keep_skip_ln = bool(self.options.get("fuse_skip_layer_norm", False))
        so = ort_session_options(threads, self.options.get("opt_level", "all"),
                                 spinning=None if spinning is None else bool(spinning),
                                 spin_between_runs=None if between is None else bool(between),
                                 disabled_optimizers=() if keep_skip_ln else self.slow_fusions)
        if weights is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights))
        return so

    def _check_options(self) -> None:
        """The CPU runner refuses an option it does not take (a GPU runner checks its own: ort_gpu_runner.py)."""
        unknown = set(self.options) - set(OPTIONS)
        if unknown:
            raise XDeployError(f"unknown {self.name} option(s) {sorted(unknown)}; expected {', '.join(OPTIONS)}")

    def _load_fused(self) -> None:
        """The decode graph rewritten to keep the cache (deploy/ort_cache.py), its weights read from the artifact's
        own external-data file, or shifted to int8 (`_int8_weights_route`)."""
        from .ort_cache import fused_graph

        model, self._layers, why = fused_graph(self.artifact, self.graph.name) if self.fuses_cache \
            else (b"", 0, f"runner {self.name!r} runs the loop's cache only")
        if not self._layers:
            raise XDeployError(f"ort option stateful=True: graph {self.graph.name!r} of {self.artifact.path} does not "
                               f"rewrite to keep the KV cache in onnxruntime ({why}); keep it in the loop")
        path = self.artifact.onnx_path(self.graph.name)
        self._feeds = self.artifact.capabilities.decoding
        self.prefill_session = None
        data = path.with_name(path.name + ".data")  # the weights, where external
        size = len(model) + (data.stat().st_size if data.exists() else 0)
        route, prompts = self._int8_weights_route(path), None
        if route:
            from .ort_cache import int8_weight_graph

            try:
                with int8_weight_graph(model, path.parent) as signed:
                    if signed is not None and route == "every call":
                        self._open_fused(*signed, size, f"{path} (int8 weights)")
                        self.signed = True
                        return
                    if signed is not None:
                        prompts = ort_session(signed[0], providers=self._providers(),
                                              options=self._session_options(self.threads, weights=signed[1]),
                                              what=f"{path} (int8 weights)")
            except OSError as e:  # the temporary folder of the shifted weights: no space, not writable
                print(f"xdeploy: note: {path}: the int8 weights cannot be written to a temporary folder "
                      f"({e.strerror or e}); the uint8 weights run every call", file=sys.stderr)
        self._open_fused(model, path.parent, size, f"{path} (the KV cache kept in onnxruntime)")
        if prompts is None:
            return
        from .ort_cache import prefill_agrees

        if prefill_agrees(self.cached_step(), prompts):
            self.prefill_session, self.signed = prompts, True
        else:
            print(f"xdeploy: warning: {path}: the int8-weight prefill's logits differ from the uint8 graph's; "
                  "prompts run on the uint8 graph", file=sys.stderr)

    def _int8_weights_route(self, path: Any) -> str:
        """Where the rewritten graph's uint8 weights, shifted to int8 (deploy/ort_cache.py `signed_weights`: the
        same integer products through onnxruntime's u8*s8 kernels), are used: "" (nowhere), "every call" or
        "prompts". Option signed_prefill: None (default) takes them for every call where the CPU's u8*s8 dot
        product accumulates in int32 and one token is faster on them too (VNNI without AMX, `signed_steps_apply`):
        one session, one copy of the weights, once onnxruntime is seen to add u8*s8 exactly here (`u8s8_exact`).
        True also takes them on AMX, for prompts only: a second session, checked against the first on a prompt
        (`prefill_agrees`). False: never. Only on an int8-dynamic artifact whose CPU adds u8*s8 in int32
        (`signed_prefill_applies`)."""
        from .ort_cache import signed_prefill_applies, signed_steps_apply, u8s8_exact

        want = self.options.get("signed_prefill")
        if want is False or not signed_prefill_applies(self.artifact):
            return ""
        if not signed_steps_apply(self.artifact):
            return "prompts" if want else ""
        if u8s8_exact():
            return "every call"
        print(f"xdeploy: warning: {path}: onnxruntime does not add u8*s8 products exactly on this CPU, although its "
              "flags say VNNI; the uint8 weights run every call", file=sys.stderr)
        return ""

    def _open_fused(self, model: bytes, folder: Any, size: int, what: str) -> None:
        """`session` on the rewritten graph `model` (its weights read from `folder`; `size`: the graph's and its
        weights' bytes) with the runner's threads, or, for a small decoder, with one thread and its prompts on
        `prefill_session` with the runner's threads (sessions.one_thread_steps: at most SMALL_STEP_BYTES). The same
        graph and weights, so the same logits up to float rounding; the golden probes check the steps' session
        (it is `self.session`)."""
        self.session = ort_session(model, providers=self._providers(),
                                   options=self._session_options(self.threads, weights=folder), what=what)
        if one_thread_steps(self.threads, size):
            steps = ort_session(model, providers=self._providers(), options=self._session_options(1, weights=folder),
                                what=f"{what}; one-token steps, one thread")
            self.prefill_session, self.session = self.session, steps

    def cached_step(self) -> CachedStep:
        if not self.stateful:
            return super().cached_step()
        from .ort_cache import OrtCachedStep

        ins = {t.name: t for t in self.session.get_inputs()}
        _, heads, _, head_size = ins[self._feeds.cache_names(1)[0]].shape
        vocab = self.session.get_outputs()[0].shape[-1]
        return OrtCachedStep(self.session, self._feeds, self._layers, heads, head_size, vocab,
                             prefill=self.prefill_session)

    def _providers(self) -> tuple[Any, ...]:
        return self.providers

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.stateful:  # the decode graph's call on the rewritten graph (probes, parity)
            from .ort_cache import decode_call

            out = decode_call(self.session, self._feeds, self._layers, feeds)
            return {n: out[n] for n in self.output_names}
        try:
            outs = self.session.run(self.output_names, feeds, self.run_options)
        except Exception as e:  # onnxruntime's own exception types: a kernel refusing these inputs, say
            raise XDeployError(f"onnxruntime run of graph {self.graph.name!r} failed: {ort_reason(e)}") from None
        return dict(zip(self.output_names, outs))

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """IO binding: inputs bound once in place (no copy per call), outputs allocated by the session."""
        if self.stateful:
            return super().prepare(feeds)
        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        binding = self.session.io_binding()
        for name, a in checked.items():
            binding.bind_cpu_input(name, a)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        run, options = self.session.run_with_iobinding, self.run_options
        return lambda: run(binding, options)

    def bind(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> Callable[[], None]:
        return self.bind_with(inputs, outputs)

    def bind_with(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], run_options: Any = None
                  ) -> Callable[[], None]:
        """IO binding onto the caller's buffers, both ways, with no copy at bind or run time.

        `bind_cpu_input` wraps a numpy array's own memory in an OrtValue (onnxruntime keeps a reference to the
        array, see IOBinding.bind_cpu_input), so in-place changes between calls are seen by the next run;
        outputs are bound by raw pointer (`buffer_ptr`) with their fixed shape and dtype, so the session writes
        straight into them. Arrays must be C-contiguous with the graph's dtype, otherwise binding would copy.
        torch tensors (LoopArrays on a device: the GPU runners' KV cache) are bound by address on their own
        device, in and out, so a GPU session reads and writes them where they are. `run_options`: onnxruntime
        RunOptions of every run of this binding (a GPU runner's CUDA graph id: _OrtGpuRunner.bind)."""
        if self.stateful:  # the decode graph's call emulated (see _run): the base class's copying bind
            return super().bind(inputs, outputs)
        tensors = {n: a for n, a in (*inputs.items(), *outputs.items()) if is_tensor(a)}
        # the checks every bind makes, with a tensor's shape and dtype standing in for it (np.zeros: calloc'd pages,
        # none touched for a big cache; zeros, not np.empty's garbage, for the ids check of a token tensor)
        stand_in = {n: np.zeros(tuple(t.shape), numpy_dtype(t)) for n, t in tensors.items() if n in inputs}
        checked = self.check_bound({**inputs, **stand_in}, outputs)
        declared = {t.name: t for t in self.graph.outputs}
        binding = self.session.io_binding()
        host = {n: a for n, a in checked.items() if n not in tensors}
        for name, a in host.items():
            binding.bind_cpu_input(name, a)
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise XDeployError(f"bound tensor {name!r} must be contiguous")
            dtype = numpy_dtype(t)
            where = (t.device.type, t.device.index or 0, dtype, list(t.shape), t.data_ptr())
            if name in inputs:
                binding.bind_input(name, *where)
            elif dtype != np.dtype(declared[name].dtype):
                raise XDeployError(f"bound output {name!r} must hold {declared[name].dtype}, not {dtype}")
            else:
                binding.bind_output(name, *where)
        for name, buf in outputs.items():
            if name in tensors:
                continue
            if not isinstance(buf, np.ndarray) or buf.dtype != np.dtype(declared[name].dtype) \
                    or not buf.flags.c_contiguous or not buf.flags.writeable:
                raise XDeployError(f"bound output {name!r} must be a writeable C-contiguous "
                                   f"{declared[name].dtype} numpy array")
            binding.bind_output(name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        for name in self.output_names:
            if name not in outputs:  # not wanted by the caller: let the session allocate it
                binding.bind_output(name, "cpu")
        return _BoundCall(self.session, binding, self.graph.name, (host, dict(outputs), tensors),
                          rebind=not self.binds_in_place, run_options=run_options)

    def info(self) -> RunnerInfo:
        import onnxruntime as ort

        # the threads asked: a small decoder's steps session has one (one_thread_steps), its prompts' the rest
        so = (self.prefill_session or self.session).get_session_options()
        return RunnerInfo(runner=self.name, device="cpu", precision=self.artifact.precision,
                          threads=so.intra_op_num_threads or usable_cpus(),
                          versions={"onnxruntime": ort.__version__})

    def close(self) -> None:
        self.__dict__.pop("session", None)


class _BoundCall:
    """One bound run. Holds the bound buffers (their memory must outlive the binding: host inputs, outputs, tensors)
    and the binding (tests read `binding.get_outputs()` to check the outputs alias the caller's buffers); with
    `rebind`, binds the host inputs again before each run (OrtRunner.binds_in_place). Bound CUDA tensors are
    written by torch on its stream (the loop's slot writes): that stream is waited on before each run, which
    onnxruntime runs on a stream of its own and synchronizes before it returns."""

    def __init__(self, session: Any, binding: Any, graph: str, buffers: tuple[dict, dict, dict], *,
                 rebind: bool = False, run_options: Any = None) -> None:
        self.session, self.binding, self.graph, self.buffers = session, binding, graph, buffers
        self.rebind, self.run_options = rebind, run_options
        cuda = {t.device for t in buffers[2].values() if t.device.type == "cuda"}
        if cuda:
            import torch

            self.waits = [torch.cuda.current_stream(d).synchronize for d in cuda]
        else:
            self.waits = []

    def __call__(self) -> None:
        if self.rebind:
            for name, a in self.buffers[0].items():
                self.binding.bind_cpu_input(name, a)
        for wait in self.waits:
            wait()
        try:
            self.session.run_with_iobinding(self.binding, self.run_options)
        except Exception as e:  # onnxruntime's own exception types
            raise XDeployError(f"onnxruntime run of graph {self.graph!r} failed: {ort_reason(e)}") from None
