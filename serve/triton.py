"""Triton Inference Server model repositories from an artifact.

    from xdeploy.serve.triton import TritonOptions, write_repository
    rec = write_repository("artifacts/minilm", "triton-repo", TritonOptions(max_batch_size=32, instances=2))

What is written (atomically: a temporary directory renamed into place), for a model named N:

    DIR/N_onnx/config.pbtxt        platform onnxruntime_onnx (tensorrt_plan with an engine file; backend python with
                                   --graph-backend python, for Triton builds without onnxruntime): inputs/outputs
    DIR/N_onnx/1/model.onnx        from the manifest (batch axis -> max_batch_size, other named axes -> -1),
                                   dynamic batching, instance groups, ORT execution accelerators (OpenVINO/TensorRT)
  and, for a text encoder with a tokenizer (strings in, vectors out):
    DIR/N_tokenizer/               the artifact's tokenizer graph (export --tokenizer-graph) on the onnxruntime
                                   backend, onnxruntime-extensions as its custom-op library (model_operations),
                                   text (BYTES [1]) -> input_ids/attention_mask/token_type_ids; without a graph
                                   (or with --graph-backend python): Python backend, HF tokenizers
    DIR/N_pooling/                 Python backend: last_hidden_state + attention_mask -> EMBEDDING (manifest pooling)
    DIR/N/config.pbtxt, 1/         ensemble: TEXT -> tokenizer -> N_onnx -> pooling -> EMBEDDING
    DIR/xdeploy-triton.json        what was written and from which artifact (sha256 of the graph)

config.pbtxt files are built as Triton's own ModelConfig protobuf (from tritonclient) and printed in protobuf
text format, so a field Triton does not know cannot be written. The Python-backend models are self-contained
(numpy + tokenizers; no xdeploy on the server): their sources are serve/triton_tokenizer_model.py and
serve/triton_pooling_model.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.core.fsutil import atomic_dir, atomic_write_json, atomic_write_text
from xdeploy.deploy.sessions import ORT_CPU_SLOW_FUSIONS
from xdeploy.export.artifact import Artifact, load_artifact
from xdeploy.export.tensorrt import int8_format
from xdeploy.models.spec import Graph, TensorSpec

KINDS = ("cpu", "gpu")
ACCELERATORS = ("none", "openvino", "tensorrt")
GRAPH_BACKENDS = ("onnxruntime", "python")
TOKENIZERS = ("hf", "graph")
DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16",
          "bool": "TYPE_BOOL"}  # models/spec.py DTYPES -> Triton's data types
TEMPLATES = Path(__file__).parent  # triton_tokenizer_model.py, triton_pooling_model.py
TEXT_INPUT, EMBEDDING_OUTPUT = "TEXT", "EMBEDDING"
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
RECORD = "xdeploy-triton.json"


@dataclass(frozen=True)
class TritonOptions:
    max_batch_size: int = 32  # <= the artifact's batch axis max
    instances: int = 1  # model instances per instance group (CPU: one ORT session each)
    kind: str = "cpu"  # KIND_CPU | KIND_GPU
    accelerator: str = "none"  # ORT execution accelerator: openvino (CPU) or tensorrt (GPU)
    max_queue_delay_us: int = 2000  # how long the dynamic batcher may hold a request to form a bigger batch
    preferred_batch_sizes: tuple[int, ...] = ()  # () = powers of two up to max_batch_size (>= 4)
    name: str | None = None  # model name; default: the artifact's model family ("bert")
    engine: str | None = None  # a TensorRT engine file: platform tensorrt_plan instead of onnxruntime_onnx
    pad_to: int = 8  # tokenizer pads each request to a multiple of this (fewer shapes -> more batching)
    threads: int = 0  # ORT intra-op threads per instance (0 = ORT default)
    graph_backend: str = "onnxruntime"  # "python": the graph runs in a Python-backend model with onnxruntime
    # onnxruntime-extensions library the server loads for the tokenizer graph (op_library_filename); None: the
    # one installed here (its path must exist on the server too)
    extensions_library: str | None = None
    # the tokenizer step: "hf" = HF tokenizers on the artifact's tokenizer.json in a Python-backend model (exact,
    # the Embedder's and the C++ runtime's ids); "graph" = the artifact's tokenizer graph on the onnxruntime
    # backend (export --tokenizer-graph; not exact on every input, docs/embedding.md)
    tokenizer: str = "hf"


@dataclass(frozen=True)
class RepositoryRecord:
    path: str
    name: str  # the model clients call (the ensemble for text encoders)
    models: tuple[str, ...]
    platform: str
    max_batch_size: int
    text: bool  # strings in, vectors out
    options: Mapping[str, Any] = field(default_factory=dict)


def _pb() -> Any:
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise XDeployError("writing Triton configs needs tritonclient: pip install 'xdeploy[serve]'") from None
    return model_config_pb2


def to_pbtxt(config: Any) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(config)


def parse_pbtxt(text: str) -> Any:
    """config.pbtxt text -> ModelConfig protobuf (raises XDeployError on text Triton would refuse)."""
    from google.protobuf import text_format

    try:
        return text_format.Parse(text, _pb().ModelConfig())
    except text_format.ParseError as e:
        raise XDeployError(f"invalid config.pbtxt: {e}") from None


def _validate(art: Artifact, o: TritonOptions) -> None:
    if o.kind not in KINDS:
        raise one_of("instance kind", o.kind, KINDS)
    if o.accelerator not in ACCELERATORS:
        raise one_of("accelerator", o.accelerator, ACCELERATORS)
    if o.accelerator == "tensorrt" and o.kind != "gpu":
        raise XDeployError("--accelerator tensorrt runs on GPU instances; pass --kind gpu (or use openvino on CPU)")
    if o.accelerator == "openvino" and o.kind != "cpu":
        raise XDeployError("--accelerator openvino is a CPU execution accelerator; pass --kind cpu")
    if o.graph_backend not in GRAPH_BACKENDS:
        raise one_of("graph backend", o.graph_backend, GRAPH_BACKENDS)
    if o.tokenizer not in TOKENIZERS:
        raise one_of("tokenizer", o.tokenizer, TOKENIZERS)
    if o.tokenizer == "graph" and art.tokenizer_graph is None:
        raise XDeployError(f"artifact {art.path} has no tokenizer graph; export it with --tokenizer-graph or use "
                           "the exact HF tokenizer step (--tokenizer hf)")
    if o.tokenizer == "graph" and o.graph_backend == "python":
        raise XDeployError("--tokenizer graph runs on Triton's onnxruntime backend: not with --graph-backend python")
    if o.graph_backend == "python" and (o.accelerator != "none" or o.engine or o.kind != "cpu"):
        raise XDeployError("--graph-backend python runs onnxruntime on CPU: no --accelerator, --engine or --kind gpu")
    if o.engine is not None:
        if not Path(o.engine).is_file():
            raise XDeployError(f"TensorRT engine file {o.engine} does not exist")
        if o.kind != "gpu" or o.accelerator != "none":
            raise XDeployError("a TensorRT engine (--engine) needs --kind gpu and --accelerator none")
    bmax = art.spec.axes["batch"].max if "batch" in art.spec.axes else 0
    if _batched(art.graph()) and not 1 <= o.max_batch_size <= bmax:
        raise XDeployError(f"max_batch_size must be 1..{bmax} (the artifact's batch axis), got {o.max_batch_size}")
    if not 1 <= o.instances <= 64:
        raise XDeployError(f"instances must be 1..64, got {o.instances}")
    if o.max_queue_delay_us < 0:
        raise XDeployError(f"max_queue_delay_us must be >= 0, got {o.max_queue_delay_us}")
    if any(not 1 <= b <= o.max_batch_size for b in o.preferred_batch_sizes):
        raise XDeployError(f"preferred batch sizes must be 1..{o.max_batch_size}, got {list(o.preferred_batch_sizes)}")
    if o.pad_to < 1:
        raise XDeployError(f"pad_to must be >= 1, got {o.pad_to}")
    name = o.name or art.model
    if not name.replace("_", "").replace("-", "").isalnum():
        raise XDeployError(f"model name {name!r} must be letters, digits, '_' or '-'")


def _batched(g: Graph) -> bool:
    """Triton batching needs every tensor's first dim to be the batch axis (it is then left out of dims)."""
    return all(t.dims and t.dims[0] == "batch" for t in (*g.inputs, *g.outputs))


def _dims(t: TensorSpec, batched: bool) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in (t.dims[1:] if batched else t.dims)]


def _preferred(o: TritonOptions) -> list[int]:
    if o.preferred_batch_sizes:
        return sorted(set(o.preferred_batch_sizes))
    sizes, b = [], 4
    while b <= o.max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes or [o.max_batch_size]


def _instances(pb: Any, o: TritonOptions) -> Any:
    kind = pb.ModelInstanceGroup.KIND_GPU if o.kind == "gpu" else pb.ModelInstanceGroup.KIND_CPU
    return pb.ModelInstanceGroup(count=o.instances, kind=kind)


def _batching(pb: Any, cfg: Any, o: TritonOptions, *, preferred: bool = True) -> None:
    cfg.dynamic_batching.max_queue_delay_microseconds = o.max_queue_delay_us
    if preferred:
        cfg.dynamic_batching.preferred_batch_size.extend(_preferred(o))


def _profile(art: Artifact, g: Graph, pick: Any, max_batch: int) -> str:
    """TensorRT EP profile string "input_ids:1x1,attention_mask:1x1" from the manifest's axes."""
    def dim(d: int | str) -> int:
        if isinstance(d, int):
            return d
        n = pick(art.spec.axes[d])
        return min(n, max_batch) if d == "batch" and max_batch else n

    return ",".join(f"{t.name}:{'x'.join(str(dim(d)) for d in t.dims)}" for t in g.inputs)


TRT_CACHE_ROOT = "/tmp/triton-trt-cache"
# Triton onnxruntime_backend src/onnxruntime.cc maps precision_mode FP16 -> trt_fp16_enable, INT8 ->
# trt_int8_enable (no calibration table: a Q/DQ graph carries its scales), and FP32 -> neither.
TRT_PRECISION_MODES = {"fp32": "FP32", "fp16": "FP16", "int8": "INT8"}


def trt_precision_mode(precision: str, int8_format: str | None = None) -> str:
    """The TensorRT accelerator's precision_mode for an artifact precision: fp32 stays FP32 (FP16 would let
    TensorRT run an fp32 artifact in half precision behind the parity the artifact was checked at); int8 must be
    a static Q/DQ graph (TensorRT has no importer for onnxruntime's dynamic quantization ops)."""
    if precision not in TRT_PRECISION_MODES:
        raise one_of("artifact precision for the TensorRT accelerator", precision, TRT_PRECISION_MODES)
    if precision == "int8" and int8_format != "qdq":
        raise XDeployError("--accelerator tensorrt needs a static Q/DQ int8 artifact; this int8 artifact is "
                           f"{int8_format or 'not Q/DQ'} (DynamicQuantizeLinear/MatMulInteger have no TensorRT "
                           "importer): serve its fp32/fp16 artifact, or drop --accelerator")
    return TRT_PRECISION_MODES[precision]


def trt_cache_path(art: Artifact, name: str) -> str:
    """The TensorRT engine cache directory of one model, keyed by its graph's sha256: the EP keys cached engines
    by the model's path and structure, so a model replaced in place under the same name would otherwise meet its
    predecessor's engines (and shared paths would mix models)."""
    sha = art.manifest["files"][art.manifest["graphs"][art.graph().name]["file"]]
    return f"{TRT_CACHE_ROOT}/{name}-{art.precision}-{sha[:16]}"


def onnx_model_config(art: Artifact, name: str, o: TritonOptions) -> Any:
    """The ModelConfig of the graph itself (onnxruntime_onnx, or tensorrt_plan with an engine)."""
    pb = _pb()
    g = art.graph()
    batched = _batched(g)
    cfg = pb.ModelConfig(name=name, max_batch_size=o.max_batch_size if batched else 0)
    if o.engine:
        cfg.platform, cfg.default_model_filename = "tensorrt_plan", "model.plan"
    elif o.graph_backend == "python":
        cfg.backend = "python"  # serve/triton_onnx_model.py runs model.onnx with onnxruntime
        # ... with the optimizers xdeploy's CPU sessions leave out (deploy/sessions.py: it cannot import xdeploy)
        cfg.parameters["ort_disabled_optimizers"].string_value = ";".join(ORT_CPU_SLOW_FUSIONS)
    else:
        cfg.platform, cfg.default_model_filename = "onnxruntime_onnx", "model.onnx"
    for t, coll in [(t, cfg.input) for t in g.inputs] + [(t, cfg.output) for t in g.outputs]:
        coll.add(name=t.name, data_type=getattr(pb, DTYPES[t.dtype]), dims=_dims(t, batched))
    if batched:
        _batching(pb, cfg, o)
    cfg.instance_group.append(_instances(pb, o))
    if o.accelerator != "none":
        acc = pb.ModelOptimizationPolicy.ExecutionAccelerators.Accelerator(name=o.accelerator)
        if o.accelerator == "tensorrt":
            # ORT's TensorRT EP inside Triton's onnxruntime backend; engines cached across restarts
            fmt = int8_format(art.onnx_path()) if art.precision == "int8" else None
            acc.parameters["precision_mode"] = trt_precision_mode(art.precision, fmt)
            acc.parameters["max_workspace_size_bytes"] = str(1 << 30)
            acc.parameters["trt_engine_cache_enable"] = "true"
            acc.parameters["trt_engine_cache_path"] = trt_cache_path(art, name)
            # one optimization profile over the manifest's axes (batch capped at max_batch_size), so TensorRT
            # builds once for the whole range instead of per new shape
            for key, pick in (("min", lambda a: a.min), ("opt", lambda a: a.opt), ("max", lambda a: a.max)):
                acc.parameters[f"trt_profile_{key}_shapes"] = _profile(art, g, pick, o.max_batch_size if batched else 0)
            cfg.optimization.execution_accelerators.gpu_execution_accelerator.append(acc)
        else:
            cfg.optimization.execution_accelerators.cpu_execution_accelerator.append(acc)
    if not o.engine and o.threads:
        # onnxruntime backend parameters (strings): intra-op threads per instance, sequential executor
        cfg.parameters["intra_op_thread_count"].string_value = str(o.threads)
        cfg.parameters["inter_op_thread_count"].string_value = "1"
    return cfg


def _text_encoder(art: Artifact) -> bool:
    g = art.graph()
    names = [t.name for t in g.inputs]
    return (art.tokenizer_dir is not None and "input_ids" in names and set(names) <= set(TEXT_INPUTS)
            and "last_hidden_state" in [t.name for t in g.outputs] and _batched(g))


def _hidden(art: Artifact) -> TensorSpec:
    out = next(t for t in art.graph().outputs if t.name == "last_hidden_state")
    if not isinstance(out.dims[-1], int):
        raise XDeployError(f"artifact {art.path}: last_hidden_state has no fixed hidden size ({out.dims})")
    return out


def _graph_tokenizer(art: Artifact, o: TritonOptions) -> bool:
    """The tokenizer step is the artifact's tokenizer graph on the onnxruntime backend (asked for with
    tokenizer="graph"), not the exact Python-backend HF tokenizer."""
    return o.tokenizer == "graph" and art.tokenizer_graph is not None and o.graph_backend == "onnxruntime"


def tokenizer_graph_config(art: Artifact, name: str, o: TritonOptions, ids: list[str]) -> Any:
    """The artifact's tokenizer graph (tokenizer/tokenizer.onnx) on Triton's onnxruntime backend, with the
    onnxruntime-extensions library as its custom-op library (model_operations.op_library_filename):
    text BYTES [b, 1] (reshaped to the graph's [b]) -> input_ids/attention_mask/token_type_ids INT64 [b, s]."""
    from xdeploy.export.tokenizer_graph import extensions_library

    pb = _pb()
    cfg = pb.ModelConfig(name=name, platform="onnxruntime_onnx", default_model_filename="model.onnx",
                         max_batch_size=o.max_batch_size)
    cfg.input.add(name="text", data_type=pb.TYPE_STRING, dims=[1], reshape=pb.ModelTensorReshape(shape=[]))
    for n in ids:
        cfg.output.add(name=n, data_type=pb.TYPE_INT64, dims=[-1])
    _batching(pb, cfg, o, preferred=False)
    cfg.instance_group.append(pb.ModelInstanceGroup(count=o.instances, kind=pb.ModelInstanceGroup.KIND_CPU))
    cfg.model_operations.op_library_filename.append(o.extensions_library or extensions_library())
    # level -1 = basic optimizations: ORT_ENABLE_ALL spends seconds copying the vocabulary attribute at load
    cfg.optimization.graph.level = -1
    cfg.parameters["intra_op_thread_count"].string_value = "1"
    cfg.parameters["inter_op_thread_count"].string_value = "1"
    return cfg


def text_model_configs(art: Artifact, name: str, o: TritonOptions) -> dict[str, Any]:
    """tokenizer -> N_onnx -> pooling (python), wrapped in an ensemble named `name`. The tokenizer is the
    artifact's tokenizer graph on the onnxruntime backend when it has one (graph_backend onnxruntime), else the
    Python-backend HF tokenizer (serve/triton_tokenizer_model.py; PyTriton's tritonserver has only Python)."""
    from xdeploy.deploy.embedder import artifact_pooling

    pb = _pb()
    g = art.graph()
    pooling = artifact_pooling(art)
    smax = art.spec.axes[art.capabilities.token_axis].max
    max_length = min(pooling.max_length or smax, smax)
    hidden = _hidden(art)
    d = hidden.dims[-1]
    ids = [t.name for t in g.inputs]
    tok, pool, onnx = f"{name}_tokenizer", f"{name}_pooling", f"{name}_onnx"

    graph_tok = _graph_tokenizer(art, o)
    if graph_tok:
        tcfg = tokenizer_graph_config(art, tok, o, ids)
    else:
        tcfg = pb.ModelConfig(name=tok, backend="python", max_batch_size=o.max_batch_size)
        tcfg.input.add(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[1])
        for n in ids:
            tcfg.output.add(name=n, data_type=pb.TYPE_INT64, dims=[-1])
        _batching(pb, tcfg, o, preferred=False)
        tcfg.instance_group.append(pb.ModelInstanceGroup(count=o.instances, kind=pb.ModelInstanceGroup.KIND_CPU))
        for k, v in {"max_length": str(max_length), "pad_to": str(o.pad_to), "inputs": ",".join(ids)}.items():
            tcfg.parameters[k].string_value = v

    pcfg = pb.ModelConfig(name=pool, backend="python", max_batch_size=o.max_batch_size)
    # fp16 artifacts give fp16 states; the pooling model sums in float32 either way
    pcfg.input.add(name="last_hidden_state", data_type=getattr(pb, DTYPES[hidden.dtype]), dims=[-1, d])
    pcfg.input.add(name="attention_mask", data_type=pb.TYPE_INT64, dims=[-1])
    pcfg.output.add(name=EMBEDDING_OUTPUT, data_type=pb.TYPE_FP32, dims=[d])
    pcfg.instance_group.append(pb.ModelInstanceGroup(count=o.instances, kind=pb.ModelInstanceGroup.KIND_CPU))
    pcfg.parameters["mode"].string_value = pooling.mode
    pcfg.parameters["normalize"].string_value = "true" if pooling.normalize else "false"

    ecfg = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=o.max_batch_size)
    ecfg.input.add(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[1])
    ecfg.output.add(name=EMBEDDING_OUTPUT, data_type=pb.TYPE_FP32, dims=[d])
    steps = ecfg.ensemble_scheduling.step
    s = steps.add(model_name=tok, model_version=-1)
    s.input_map["text" if graph_tok else TEXT_INPUT] = TEXT_INPUT
    for n in ids:
        s.output_map[n] = f"_{n}"
    s = steps.add(model_name=onnx, model_version=-1)
    for n in ids:
        s.input_map[n] = f"_{n}"
    s.output_map["last_hidden_state"] = "_last_hidden_state"
    s = steps.add(model_name=pool, model_version=-1)
    s.input_map["last_hidden_state"] = "_last_hidden_state"
    s.input_map["attention_mask"] = "_attention_mask"
    s.output_map[EMBEDDING_OUTPUT] = EMBEDDING_OUTPUT
    return {tok: tcfg, pool: pcfg, name: ecfg}


def write_repository(artifact: Artifact | str | Path, out: str | Path, options: TritonOptions | None = None, *,
                     force: bool = False) -> RepositoryRecord:
    """Write a Triton model repository for the artifact (see the module docstring for the layout)."""
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    o = options or TritonOptions()
    _validate(art, o)
    name = o.name or art.model
    text = _text_encoder(art)
    onnx_name = f"{name}_onnx" if text else name
    configs = {onnx_name: onnx_model_config(art, onnx_name, o)}
    if text:
        configs.update(text_model_configs(art, name, o))
    with atomic_dir(out, force=force) as tmp:
        for model, cfg in configs.items():
            (tmp / model / "1").mkdir(parents=True)
            atomic_write_text(tmp / model / "config.pbtxt", to_pbtxt(cfg))
        if o.engine:
            shutil.copyfile(o.engine, tmp / onnx_name / "1" / "model.plan")
        else:
            shutil.copyfile(art.onnx_path(), tmp / onnx_name / "1" / "model.onnx")
            if o.graph_backend == "python":
                shutil.copyfile(TEMPLATES / "triton_onnx_model.py", tmp / onnx_name / "1" / "model.py")
            data = art.onnx_path().with_name(art.onnx_path().name + ".data")
            if data.exists():  # external weights (> 2 GB graphs) sit beside the graph under the same name
                shutil.copyfile(data, tmp / onnx_name / "1" / data.name)
        if text:
            tok_dir = tmp / f"{name}_tokenizer" / "1"
            if _graph_tokenizer(art, o):
                shutil.copyfile(art.tokenizer_graph, tok_dir / "model.onnx")
            else:
                shutil.copyfile(TEMPLATES / "triton_tokenizer_model.py", tok_dir / "model.py")
                shutil.copyfile(art.tokenizer_dir / "tokenizer.json", tok_dir / "tokenizer.json")
            shutil.copyfile(TEMPLATES / "triton_pooling_model.py", tmp / f"{name}_pooling" / "1" / "model.py")
        rec = RepositoryRecord(path=str(Path(out)), name=name, models=tuple(sorted(configs)),
                               platform=configs[onnx_name].platform or configs[onnx_name].backend,
                               max_batch_size=configs[onnx_name].max_batch_size,
                               text=text, options=asdict(o))
        atomic_write_json(tmp / RECORD, {"artifact": str(art.path), "graph_sha256": art.manifest["files"].get(
            art.manifest["graphs"]["model"]["file"]), **asdict(rec)})
    return rec
