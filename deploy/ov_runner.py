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
may use any shape inside the exported range. An ONNX graph of xdeploy's own export is compiled without the
NaN guard OpenVINO's frontend puts after each attention (`drop_nan_guards`; `nan_guards_dropped` counts them).

    open_runner("ov", art, "decode", stateful=True)          # the KV cache kept inside the engine
    open_runner("ov", art, "decode", stateful=True, kv_precision="u8")   # ... stored as u8 (OpenVINO's default)
    open_runner("ov", art, "decode", stateful=True, paged=True)          # ... in PagedAttention blocks (decoders)

Option `stateful` compiles, in place of a decode graph, the stateful IR an fp32 artifact with an IR carries for
it (export/openvino_ir.py `stateful_ir`): the cache lives in the infer request, and the CPU plugin fuses each
layer's ReadValue -> Concat -> SDPA -> Assign into one attention node that appends in place, so a step reads and
writes no cache through the caller. The decoding loop drives it through `cached_step()` (deploy/generate.py);
`infer` still takes the decode graph's feeds and returns its outputs (the given cache is loaded into the state
and the step's K/V read back from it), so golden probes and parity check the stateful IR as the decode graph.
Option `paged` rewrites a decoder's stateful IR to OpenVINO's PagedAttention form (deploy/ov_paged.py).

    open_runner("ov", art, "decode", stateful=True, paged=True, weights="bf16")   # bf16-stored weights, f32 math

Option `weights="bf16"` (fp32 artifacts, the f32 variant) stores the compiled model's f32 weights as bf16 behind
decompression Converts (export/openvino_ir.py `bf16_weights`): the CPU plugin decompresses them inside its kernels
and computes in f32, so a memory-bound decode step reads half the bytes without bf16 arithmetic. With it, option
`prompt="bf16"` (the paged step) compiles the same bf16-weight model a second time with OpenVINO's bf16 hint for
the calls that feed several tokens a row (prompts: compute-bound, where AMX / AVX-512 BF16 arithmetic pays), while
the one-token steps keep f32 arithmetic on the bf16 weights (at one row the bf16 kernels do not pay: on AMX they
run a tile for one row). The cache is converted once a generation, when the sequence moves from its prompt's
bf16 cache to the steps' f32 one (deploy/ov_paged.py PagedStep). Where the CPU has no bf16 (no AVX-512 BF16 or AMX)
there is no second compile: the one f32 model runs the prompts too.

    open_runner("ov", art, "decode", stateful=True, paged=True, weights="bf16", prompt="bf16")
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.deps import import_quietly, installed
from xdeploy.core.errors import XDeployError, one_of

from .base import CachedStep, Runner, RunnerInfo, validate_feeds
from .saturation_guard import refuse_saturating_int8, saturating_bound
from .sessions import OV_PRECISION_HINTS, BoundInputs, one_thread_steps, onnx_file, ov_compile, ov_config, ov_reason

_OV_TO_NAME = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
GRAPH_FORMATS = ("auto", "onnx", "ir")  # auto: the artifact's OpenVINO IR when it carries one
KV_PRECISIONS = ("f32", "bf16", "f16", "u8")  # stateful=True: the cache's element type (default: the compute's)
_IR_FALLBACKS_SAID: set[str] = set()  # int8 IRs this process fell back from (the stderr line once per file)


class OvRunner(Runner):
    name = "ov"
    nan_guards_dropped = 0  # NaN guards after attention removed from the compiled graph (drop_nan_guards)
    steps_compiled: Any = None  # paged: a small decoder's one-token steps' compiled model (one thread), else None
    prompt_compiled: Any = None  # paged, prompt="bf16": the prompts' compiled model (bf16 hint), else None
    variants = tuple(OV_PRECISION_HINTS)
    reads_openvino_ir = True
    pages_cache = True
    # the hints other than the default's (f32) compute in their own precision: ov:bf16 -> "bf16"
    variant_precisions = {v: _OV_TO_NAME[h] for v, h in OV_PRECISION_HINTS.items() if h != OV_PRECISION_HINTS[""]}
    layerwise = True

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        return [] if installed("openvino") else ["the openvino package is not installed (pip install "
                                                 "'xdeploy[openvino]')"]

    @classmethod
    def keeps_cache(cls, artifact: Any, graph: str) -> bool:
        return artifact.openvino_stateful(graph) is not None and not cls.gaps()

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
            # a tensor OpenVINO fused away keeps no name among the outputs (squeezenet's Relus into their Convs):
            # left out, layerwise skips it
            return {n: np.asarray(by_name[n]) for n in names if n in by_name}

        return run

    def _load(self) -> None:
        try:
            ov = import_quietly("openvino")
        except ImportError:
            raise XDeployError("runner 'ov' needs the openvino package: pip install 'xdeploy[openvino]'") from None
        self._ov = ov
        unknown = set(self.options) - {"hint", "cache_dir", "device", "format", "pinning", "stateful", "kv_precision",
                                       "paged", "allow_saturation", "weights", "prompt"}
        if unknown:
            raise XDeployError(f"unknown ov option(s) {sorted(unknown)}; expected hint, cache_dir, device, format, "
                               "pinning, stateful, kv_precision, paged, allow_saturation, weights, prompt")
        self._check_weights()
        self._allow_saturation = bool(self.options.pop("allow_saturation", False))
        if self.options.get("paged", False) and not self.options.get("stateful", False):
            raise XDeployError(f"ov option paged=True rewrites a decoder's stateful decode step: expected "
                               f"stateful=True too (graph {self.graph.name!r})")
        fmt = self.options.get("format", "auto")
        if fmt not in GRAPH_FORMATS:
            raise one_of("ov graph format", fmt, GRAPH_FORMATS)
        config = ov_config(self.variant, hint=self.options.get("hint", "latency"), threads=self.threads,
                           cache_dir=self.options.get("cache_dir"), pinning=self.options.get("pinning"))
        self.device = str(self.options.get("device", "CPU"))
        # One infer request per thread (`_local`): an OpenVINO request is not re-entrant ("Infer Request is
        # busy"), while the compiled model is thread-safe and shares its weights between requests.
        self._local = threading.local()
        if self.options.get("stateful", False):
            self._load_stateful(config, fmt)
            return
        # The artifact's OpenVINO IR (converted from the reference module: fewer layout ops once compiled,
        # export/openvino_ir.py) when it has one, else the ONNX graph; format="onnx" / "ir" forces one.
        ir = self.artifact.openvino_ir(self.graph.name)
        if fmt == "ir" and ir is None:
            raise XDeployError(f"artifact {self.artifact.path} carries no OpenVINO IR for graph {self.graph.name!r}; "
                               "export it with --openvino-ir (fp32) or use format='onnx'")
        if ir is not None and fmt == "auto" and self._ir_saturates(ir):
            ir = None  # the 7-bit Q/DQ ONNX graph instead of an 8-bit int8 IR this CPU would saturate (one line said)
        path = ir if ir is not None and fmt != "onnx" else self.artifact.onnx_path(self.graph.name)
        self.graph_format = "ir" if path == ir else "onnx"
        self._refuse_saturation(path if self.graph_format == "ir" else None)
        # Compiling from the path (not a read_model result) lets the cache skip reading the ONNX file
        # entirely when a blob for this model + config exists; with an `outputs` subset the unused results
        # are removed first, so the plugin prunes the branches that only fed them. An ONNX graph of our own
        # export is read first to drop the frontend's NaN guards after attention (`drop_nan_guards`).
        pruned = len(self.output_names) < len(self.graph.outputs)
        ours = self.graph_format == "onnx" and self.artifact.foreign is None
        model: Any = self._pruned(path) if pruned or ours else path
        if ours:
            self.nan_guards_dropped = drop_nan_guards(model)
        if not (pruned or self.nan_guards_dropped):
            model = path  # nothing changed: keep the path route (and its cache skip)
        self.compiled = ov_compile(self._stored_weights(model, path if self.graph_format == "ir" else None), config,
                                   self.device, what=str(path))
        # A port can carry several tensor names (an fp16 graph's keep-io Cast adds one); index them all.
        self._in_ports = {n: p for p in self.compiled.inputs for n in p.get_names()}
        self._out_ports = {n: p for p in self.compiled.outputs for n in p.get_names()}
        missing = [t.name for t in self.graph.inputs if t.name not in self._in_ports] + \
                  [n for n in self.output_names if n not in self._out_ports]
        if missing:  # a foreign graph's input OpenVINO's frontend dropped (one only a sequence op reads), say
            raise XDeployError(f"OpenVINO compiled {path.name} without its tensor(s) {missing} (its frontend dropped "
                               "or renamed them): this runner cannot feed or read that graph")

    def _check_weights(self) -> None:
        """Option weights="bf16": an fp32 artifact's weights stored as bf16 in the compiled model, the arithmetic
        f32 (export/openvino_ir.bf16_weights): half the bytes a decode step reads, without bf16 arithmetic."""
        weights = self.options.get("weights", "")
        if weights not in ("", "bf16"):
            raise one_of("ov weights", weights, ["bf16"])
        if weights and OV_PRECISION_HINTS[self.variant] != "f32":
            raise XDeployError("ov option weights='bf16' stores the weights as bf16 and computes in f32: expected "
                               f"the f32 variant (ov or ov:f32), not ov:{self.variant}")
        if weights and self.artifact.precision != "fp32":
            raise XDeployError(f"ov option weights='bf16' rounds an fp32 artifact's weights to bf16; "
                               f"{self.artifact.path} is {self.artifact.precision}")
        prompt = self.options.get("prompt", "")
        if prompt not in ("", "bf16"):
            raise one_of("ov prompt", prompt, ["bf16"])
        if prompt and not (weights and self.options.get("paged", False)):
            raise XDeployError("ov option prompt='bf16' runs the paged step's prompts with bf16 arithmetic on its bf16 "
                               "weights: expected weights='bf16' and paged=True with it")

    def _stored_weights(self, model: Any, ir: Path | None) -> Any:
        """`model` (a path or an ov.Model) to compile, its f32 weights stored as bf16 under weights="bf16"; `ir`:
        the OpenVINO IR xml it comes from, if it does (its weights are then read from the file, bf16_weights)."""
        if not self.options.get("weights"):
            return model
        from xdeploy.export.openvino_ir import bf16_weights

        if not isinstance(model, self._ov.Model):
            model = self._ov.Core().read_model(str(model))
        if not bf16_weights(self._ov, model, ir):
            raise XDeployError(f"ov option weights='bf16': {self.artifact.path} graph {self.graph.name!r} has no f32 "
                               "weights to store as bf16")
        return model

    def _ir_saturates(self, ir: Path) -> bool:
        """A static int8 artifact's NNCF IR (8-bit weights: NNCF's default fixes the first layer only) that this
        CPU would saturate (x86 without VNNI or AMX): the runner then compiles the artifact's Q/DQ ONNX graph, whose
        7-bit weights cannot saturate, and says so on stderr once per graph file."""
        if self.artifact.precision != "int8" or self._allow_saturation:
            return False
        bound = saturating_bound(self.artifact, self.graph.name, ir=ir)
        if bound is not None and str(ir) not in _IR_FALLBACKS_SAID:
            _IR_FALLBACKS_SAID.add(str(ir))
            print(f"xdeploy: {ir} has 8-bit int8 weights (a pair reaches {bound['worst_pair_bound']} > "
                  f"{bound['limit']}) that OpenVINO saturates on this CPU (no VNNI or AMX); compiling the "
                  "artifact's Q/DQ ONNX graph (7-bit weights) instead", file=sys.stderr)
        return bound is not None

    def _refuse_saturation(self, ir: Path | None) -> None:
        """On x86 without VNNI or AMX, refuse int8 weights the CPU plugin would saturate (deploy/saturation_guard.py):
        those of a static int8 artifact's IR at `ir`, or of its Q/DQ ONNX graph. int8-dynamic graphs are not
        refused: OpenVINO computes MatMulInteger in f32 (exact on every class; 8-bit weights passed on Zen 3 and
        as that class under QEMU) and their IR holds weight-only uint8."""
        if self.artifact.precision == "int8" and not self._allow_saturation:
            refuse_saturating_int8(self.artifact, self.graph.name, runtime="OpenVINO", ir=ir)

    def _load_stateful(self, config: dict[str, Any], fmt: str) -> None:
        """Compile the stateful IR that replaces this decode graph, and check it is the engine the loop feeds:
        inputs = the step's ids and positions, the mask, the beam index; one state per cache input."""
        rec = self.artifact.openvino_stateful(self.graph.name)
        f = self.artifact.capabilities.decoding
        if rec is None or f is None or fmt == "onnx":
            raise XDeployError(f"artifact {self.artifact.path} carries no stateful OpenVINO IR for graph "
                               f"{self.graph.name!r} (ov option stateful=True): re-export it (fp32) with --openvino-ir")
        path = self.artifact.path / rec["xml"]
        self.graph_format = "stateful"
        self._refuse_saturation(path)
        # The cache is stored in the compute precision unless asked otherwise: the CPU plugin's own default is u8
        # (a quantized cache in OpenVINO 2026.4), which would make ov "f32" something other than f32
        kv = self.options.get("kv_precision", config["INFERENCE_PRECISION_HINT"])
        if kv not in KV_PRECISIONS:
            raise one_of("ov kv_precision", kv, KV_PRECISIONS)
        self._names = (f.step_ids, f.positions, rec["mask"], rec["beam"])
        self._held = f.held()  # an encoder-decoder's memory and source mask: inputs of every step
        self._feeds = f
        # the decode graph's cache inputs, layer-major (DecoderFeeds.cache_names), one state each
        given = [t.name for t in self.graph.inputs if t.name.startswith(f"{f.cache}.")]
        cache = list(f.cache_names(len(given) // 2))
        if self.options.get("paged", False):
            self._load_paged(path, config | {"KV_CACHE_PRECISION": kv}, len(given) // 2,
                             path.stat().st_size + (self.artifact.path / rec["bin"]).stat().st_size)
            return
        self.compiled = ov_compile(self._stored_weights(path, path), config | {"KV_CACHE_PRECISION": kv}, self.device,
                                   what=str(path))
        self._in_ports = {n: p for p in self.compiled.inputs for n in p.get_names()}
        self._out_ports = {n: p for p in self.compiled.outputs for n in p.get_names()}
        states = {s.name for s in self.compiled.create_infer_request().query_state()}
        if set(self._in_ports) != {*self._names, *self._held} or f.logits not in self._out_ports \
                or sorted(given) != sorted(cache) or len(rec["variables"]) != len(cache) \
                or not set(rec["variables"]) <= states:
            raise XDeployError(f"{path} does not match its manifest: expected inputs "
                               f"{[*self._names, *self._held]}, output {f.logits!r} and {len(cache)} states "
                               f"{rec['variables'][:1]}...; found inputs {sorted(self._in_ports)} and {len(states)} "
                               "states")
        self._variables = dict(zip(cache, rec["variables"]))

    def _load_paged(self, path: Path, config: dict[str, Any], layers: int, step_bytes: int) -> None:
        """The stateful IR rewritten to PagedAttention (deploy/ov_paged.py): the cache in blocks the step owns.
        `step_bytes`: the IR's xml and bin, for the one-thread steps' rule."""
        f = self._feeds
        if self._held:
            raise XDeployError(f"ov option paged=True: {self.artifact.path} is an encoder-decoder; the PagedAttention "
                               "step is a decoder's (use the stateful step, paged=False)")
        if config["KV_CACHE_PRECISION"] == "u8":
            raise XDeployError("ov option paged=True stores the cache in the compute precision: expected "
                               "kv_precision f32, bf16 or f16, not u8")
        from xdeploy.core.fingerprint import bf16_native, fingerprint

        from .ov_paged import paged_model

        model = self._stored_weights(paged_model(self._ov, str(path), f.step_ids, f.positions, layers, f.logits), path)
        self.compiled = ov_compile(model, config, self.device, what=f"{path} (PagedAttention)")
        self._in_ports = {n: p for p in self.compiled.inputs for n in p.get_names()}
        self._out_ports = {n: p for p in self.compiled.outputs for n in p.get_names()}
        self.graph_format = "paged"
        self._layers = layers
        # a small decoder's one-token steps on a second compiled model of one thread (sessions.one_thread_steps),
        # bound to the same cache tensors as the prompts' (PagedStep `steps`)
        if one_thread_steps(self.threads, step_bytes):
            self.steps_compiled = ov_compile(model, config | {"INFERENCE_NUM_THREADS": 1}, self.device,
                                             what=f"{path} (PagedAttention, one-token steps, one thread)")
        # the prompts' bf16 compile (its PagedAttention stores the cache in the compute precision: bf16) only where
        # the CPU computes bf16: elsewhere the plugin would compute them in f32 and refuse the bf16 cache, so the
        # one f32 model runs the prompts too
        if self.options.get("prompt") and bf16_native(fingerprint()):
            self.prompt_compiled = ov_compile(model, config | {"INFERENCE_PRECISION_HINT": "bf16",
                                                               "KV_CACHE_PRECISION": "bf16"}, self.device,
                                              what=f"{path} (PagedAttention, prompts, bf16 hint)")

    def cached_step(self) -> CachedStep:
        if self.graph_format == "paged":
            from .ov_paged import PagedStep

            f = self._feeds
            prompts = self.prompt_compiled or self.compiled
            # the one-token steps: their own model (one thread), or the main one when the prompts have theirs
            steps_model = self.steps_compiled or (self.compiled if self.prompt_compiled is not None else None)

            def logits(compiled: Any) -> Any:
                return next(p for p in compiled.outputs if f.logits in p.get_names())

            steps = None if steps_model is None else \
                (steps_model.create_infer_request(), steps_model, logits(steps_model))
            return PagedStep(prompts.create_infer_request(), prompts, f.step_ids, f.positions, logits(prompts),
                             self._layers, self._ov, steps=steps)
        if self.graph_format != "stateful":
            raise XDeployError("runner 'ov' keeps the KV cache in the engine only when opened with stateful=True")
        return _OvCachedStep(self.compiled.create_infer_request(), self._names, self._out_ports[self._feeds.logits],
                             self._ov)

    def _run_stateful(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The decode graph's call on the stateful IR (probes, parity): the given cache becomes the state, the
        step runs, and its K/V are read back from the grown state."""
        f, req = self._feeds, self._request()
        by_name = {s.name: s for s in req.query_state()}
        for name, var in self._variables.items():
            by_name[var].state = self._ov.Tensor(feeds[name])
        ids = feeds[f.step_ids]
        n, s = ids.shape
        step_mask = feeds[f.step_mask] if f.step_mask else np.ones((n, s), np.int64)
        mask = np.concatenate([feeds[f.cache_mask], step_mask], 1).astype(np.int64)
        res = req.infer({self._names[0]: ids, self._names[1]: feeds[f.positions], self._names[2]: mask,
                         self._names[3]: np.arange(n, dtype=np.int32)} | {k: feeds[k] for k in self._held},
                        share_outputs=True)  # the logits are copied out once below
        grown = [np.array(by_name[var].state.data)[:, :, -s:] for var in self._variables.values()]  # (N, nh, S, hs)
        new_kv = np.stack(grown).reshape(len(grown) // 2, 2, *grown[0].shape)  # (L, 2, N, nh, S, hs)
        out = {f.logits: np.array(res[self._out_ports[f.logits]], copy=True), f.new_kv: new_kv}
        return {k: out[k] for k in self.output_names}

    def _run_paged(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The decode graph's call on the PagedAttention step (probes, parity): deploy/ov_paged.py paged_decode."""
        from .ov_paged import paged_decode

        f = self._feeds
        step = getattr(self._local, "paged", None)
        if step is None:
            step = self._local.paged = self.cached_step()
        ids = feeds[f.step_ids]
        step_mask = feeds[f.step_mask] if f.step_mask else np.ones(ids.shape, np.int64)
        names = f.cache_names(self._layers)
        logits, new = paged_decode(step, ids, feeds[f.positions], [feeds[n] for n in names], feeds[f.cache_mask],
                                   step_mask)
        new_kv = np.stack(new).reshape(self._layers, 2, *new[0].shape)  # (L, 2, N, nh, S, hs)
        out = {f.logits: logits, f.new_kv: new_kv}
        return {k: out[k] for k in self.output_names}

    def _request(self) -> Any:
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        return req

    def _pruned(self, path: Path) -> Any:
        """The graph read from `path` with only the results named in `output_names`."""
        try:
            model = self._ov.Core().read_model(str(path))
        except Exception as e:
            raise XDeployError(f"OpenVINO cannot read {path}: {ov_reason(e)}") from None
        keep = set(self.output_names)
        for res in list(model.get_results()):
            if not keep & set(res.output(0).get_names() | res.input_value(0).get_names()):
                model.remove_result(res)
        return model

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # share_inputs: OpenVINO reads the (validated, contiguous) arrays in place. share_outputs: views of the
        # request's output memory, copied out once here because the request reuses that memory on the next call
        # (without it OpenVINO copies them first, and GPT-2 prefill's 25.7 MB of logits were copied twice:
        # ~8 ms of a 97 ms call at bf16, docs/benchmarks.md).
        if self.graph_format == "paged":
            return self._run_paged(feeds)
        if self.graph_format == "stateful":
            return self._run_stateful(feeds)
        res = self._request().infer(feeds, share_inputs=True, share_outputs=True)
        return {n: np.array(res[self._out_ports[n]], copy=True) for n in self.output_names}

    def _request_on(self, arrays: Mapping[str, np.ndarray]) -> Any:
        """A new infer request whose input tensors share the arrays' memory. Each prepared/bound call owns
        its request, so a later `infer()` (which sets its own inputs) never re-points a bound call."""
        req = self.compiled.create_infer_request()
        for name, a in arrays.items():
            req.set_tensor(self._in_ports[name], self._ov.Tensor(a, shared_memory=True))
        return req

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """Inputs set once as tensors sharing the arrays' memory; each call only runs the model. (Stateful: the
        decode graph's call, the state loaded from the feeds every time.)"""
        if self.graph_format in ("stateful", "paged"):
            return super().prepare(feeds)
        req = self._request_on(validate_feeds(self.graph, self.artifact.spec.axes, feeds))
        return lambda: req.infer(None, share_outputs=True)

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """Truly zero-copy: input and output ov.Tensors wrap the caller's numpy buffers (shared_memory=True),
        so each call reads the current input contents and the CPU plugin writes results straight into the
        output arrays. Output arrays must have the exact shape the inputs imply (dims from the manifest)."""
        if self.graph_format in ("stateful", "paged"):
            return super().bind(inputs, outputs)
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
        if self.options.get("weights") == "bf16":  # f32 arithmetic on bf16-rounded weights: judged as bf16
            compute = "bf16"
        full_name = self._ov.Core().get_property(self.device, "FULL_DEVICE_NAME")
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""),
                          device=f"{self.device.lower()} ({full_name})",
                          precision=compute, threads=int(self.compiled.get_property("INFERENCE_NUM_THREADS")),
                          versions={"openvino": self._ov.get_version()})

    def close(self) -> None:
        # the infer requests live in per-thread slots of `_local`: a fresh one drops every thread's request
        self._local = threading.local()
        self.__dict__.pop("compiled", None)
        self.steps_compiled = self.prompt_compiled = None


def drop_nan_guards(model: Any) -> int:
    """Remove OpenVINO's NaN guard after attention from `model` (an ov.Model, edited in place); return how many.

    OpenVINO 2026's ONNX frontend follows each opset-23 `Attention` op with Select(IsNaN(y), 0, y): a softmax
    row whose keys are all -inf is NaN, and the guard zeroes it. The CPU plugin runs IsNaN and Select as two
    more nodes over every attention output: MiniLM's static int8 graph ran 1.03x [1.02-1.04] faster without
    them on `ov:bf16` and 1.015x on `ov:f32`, with identical vectors (docs/benchmarks.md). xdeploy's models mask
    with a finite bias (models/attention.py MASK_VALUE), so no row is all -inf and the guard could only fire on
    a NaN that came from elsewhere -- which it would hide as zeros. Callers drop it only from graphs of
    xdeploy's own export (`Artifact.foreign` is None): a foreign graph may mask with -inf and need it."""
    dropped = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Select":
            continue
        cond, zero, y = (op.input_value(i) for i in range(3))
        isnan = cond.get_node()
        if isnan.get_type_name() != "IsNaN" or isnan.input_value(0) != y \
                or y.get_node().get_type_name() != "ScaledDotProductAttention" or not _is_zero(zero.get_node()):
            continue
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(y)
        dropped += 1
    if dropped:
        model.validate_nodes_and_infer_types()
    return dropped


def _is_zero(node: Any) -> bool:
    """A scalar-zero constant, possibly behind the frontend's ConvertLike to the attention's type."""
    if node.get_type_name() == "ConvertLike":
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant" and not np.any(node.get_data())


def _axis_sizes(graph: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Axis name -> size as bound by the (validated) inputs."""
    sizes: dict[str, int] = {}
    for t in graph.inputs:
        for d, n in zip(t.dims, feeds[t.name].shape):
            if isinstance(d, str):
                sizes[d] = int(n)
    return sizes



class _OvCachedStep(CachedStep):
    """One infer request of the stateful IR: its states are the cache (see CachedStep)."""

    def __init__(self, request: Any, names: Sequence[str], logits: Any, ov: Any) -> None:
        self.req, self.names, self.logits, self._ov = request, tuple(names), logits, ov
        self._held: dict[str, np.ndarray] = {}
        self._inputs = BoundInputs(request, ov)  # ids, positions, mask and beam: bound once, copied into

    def reset(self) -> None:
        self.req.reset_state()

    def hold(self, feeds: Mapping[str, np.ndarray]) -> None:
        # set once as tensors over the arrays' memory: no step copies them (the memory is (L, 2, N, nh, S, hs))
        self._held = {k: np.ascontiguousarray(a) for k, a in feeds.items()}
        for name, a in self._held.items():
            self.req.set_tensor(name, self._ov.Tensor(a, shared_memory=True))

    def __call__(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, beam: np.ndarray) -> np.ndarray:
        for name, a in zip(self.names, (ids, positions, mask, beam)):
            self._inputs.set(name, a)
        self.req.infer()
        # a view of the request's output memory, read before the next call
        return self.req.get_tensor(self.logits).data[:, -1]
