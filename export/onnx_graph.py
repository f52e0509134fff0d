"""Reading another exporter's ONNX graph into the manifest of an artifact view (export/foreign.py has the view, the
binding of its dims and the rest; export/artifact.py `load_artifact` opens a view with `view_manifest`), and the
checks every ONNX file gets before a runtime follows it (external data inside the directory). Graphs are
untrusted input: read without their external data, one-line errors for anything xdeploy cannot run. Also the two
graph walks the int8 path and layerwise share (`subgraph_inputs`, `prune`), and `proto_size`, which every
"is this model over protobuf's 2 GB" decision uses.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import sha256_file
from xdeploy.models.sbert import TOKENIZER_FILES, _transformer_dir
from xdeploy.models.spec import DTYPES, Axis

SECTION = "foreign"
REFERENCE = "onnxruntime CPU fp32 (the foreign graph)"  # what the golden probes of a converted foreign graph hold
# Where a directory's graph is looked for, in order (Optimum and sentence-transformers: model.onnx, onnx/model.onnx)
GRAPH_FILES = ("model.onnx", "onnx/model.onnx")
# Symbolic dim names recognized (lower case, '-' and ' ' read as '_'): axis -> names. Any other dim needs --shapes.
AXIS_NAMES: Mapping[str, tuple[str, ...]] = {
    "batch": ("batch", "batch_size", "batchsize", "bs", "n", "b", "batch_dim", "num_batches"),
    "seq": ("seq", "sequence", "sequence_length", "seq_len", "seq_length", "sequence_len", "seqlen", "tokens",
            "num_tokens", "length", "max_seq_len", "text_length"),
    "height": ("height", "h", "image_height", "img_h"),
    "width": ("width", "w", "image_width", "img_w"),
}
# Ranges of the recognized axes (opt = what bench and calibration use by default); config.json may set their max.
BATCH = Axis(1, 1, 256)
SEQ = Axis(1, 128, 512)
IMAGE = 224
ANY = Axis(1, 1, 1 << 20)  # a dim not recognized: any size until --shapes binds it
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear", "QLinearMatMul", "QLinearConv", "QGemm"}
DYNAMIC_INT8_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul",
                    "MatMulIntegerToFloat"}
PASS_OPS = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}  # ids -> Gather
DENSE_OPS = {"MatMul", "Gemm", "MatMulInteger", "QLinearMatMul", "MatMulNBits", "FusedMatMul"}


def read_onnx(onnx_path: Path) -> Any:
    """The ModelProto of `onnx_path` without its external data (a one-line error for an unreadable file)."""
    import onnx

    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise XDeployError(f"{onnx_path} is not a readable ONNX model: {why}") from None


TWO_GB = 2**31  # protobuf's limit: a larger ONNX model is serialized with its weights as external data
_SLACK = 64  # bytes per message or field counted on top of its payload (tags, lengths, names of a few bytes)


MIN_OPSET, MAX_OPSET = 7, 30  # the opsets an artifact may declare (export/artifact.py checks its manifest's)


def default_opset(proto: Any) -> int:
    """The graph's opset of the default ("" / "ai.onnx") domain; 0 when it imports none."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def proto_size(message: Any) -> int:
    """An upper estimate of `message`'s serialized size (an onnx ModelProto or any part of it), without
    serializing its tensors' payload: upb's ByteSize() serializes the whole message to measure it (1.2 s for
    GPT-2 small's 0.5 GB graph, asked several times per export). A tensor with raw data counts its dims times
    its element size; everything else is measured, plus a few bytes per field. Exact enough for thresholds of
    megabytes and gigabytes; never used as a length."""
    import onnx

    if isinstance(message, onnx.TensorProto) and message.HasField("raw_data"):
        itemsize = _itemsize(message.data_type)
        if itemsize:
            n = 1
            for d in message.dims:
                n *= d
            return int(n * itemsize) + len(message.name) + _SLACK * (len(message.dims) + 4)
    if not isinstance(message, (onnx.ModelProto, onnx.GraphProto, onnx.FunctionProto, onnx.NodeProto,
                                onnx.AttributeProto)):
        return message.ByteSize()  # no payload of raw tensors to skip
    total = 0
    for _, value in message.ListFields():
        repeated = hasattr(value, "__len__") and not isinstance(value, (str, bytes))
        for v in value if repeated else [value]:
            if hasattr(v, "ListFields"):
                total += proto_size(v)
            elif isinstance(v, (str, bytes)):
                total += len(v)
            total += _SLACK
    return total


def _itemsize(data_type: int) -> float:
    """Bytes per element of an onnx tensor type's raw data (0 when not fixed: strings, unknown types)."""
    import onnx

    if data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0
    try:
        bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(data_type)
        if bits is None and hasattr(onnx.TensorProto, "FLOAT4E2M1") and data_type == onnx.TensorProto.FLOAT4E2M1:
            bits = 4
        if bits is not None:
            return bits / 8
        return float(onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)
    except (KeyError, TypeError, ValueError):
        return 0


def subgraph_inputs(node: Any) -> set[str]:
    """Every tensor name an If/Loop/Scan body of `node` reads (outer-scope tensors are read implicitly)."""
    names: set[str] = set()
    for attr in node.attribute:
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for n in g.node:
                names.update(n.input)
                names.update(subgraph_inputs(n))
    return names


def prune(model: Any, outputs: Sequence[str] | None = None) -> Any:
    """In place: keep only the nodes the tensors `outputs` depend on (default: the graph's outputs; given, they
    become the graph's outputs, in that order) and the initializers those nodes read; returns `model`.

    onnxruntime runs every node of a graph whatever is fetched: a calibration run that fetches GPT-2's hidden
    states still computed its (batch, seq, 50257) logits, a quarter of the run, until it ran a pruned graph."""
    import onnx

    g = model.graph
    if outputs is not None:
        known = {o.name: o for o in g.output}
        chosen = [known.get(t) or onnx.ValueInfoProto(name=t) for t in outputs]
        kept_out = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in chosen]
        del g.output[:]
        g.output.extend(kept_out)
    needed = {o.name for o in g.output}
    dead = []
    for k in range(len(g.node) - 1, -1, -1):  # reverse topological order: a node's readers come first
        n = g.node[k]
        if any(o in needed for o in n.output if o):
            needed.update(i for i in n.input if i)
            needed |= subgraph_inputs(n)
        else:
            dead.append(k)
    for k in dead:  # descending indices; deleted in place (no copy of the weights)
        del g.node[k]
    for k in range(len(g.initializer) - 1, -1, -1):
        if g.initializer[k].name not in needed:
            del g.initializer[k]
    return model


def check_external_data(onnx_path: Path, root: Path, proto: Any = None) -> list[str]:
    """Refuse ONNX files whose external-data locations point outside the artifact (path traversal) or at
    files that are not there, before any runtime follows them; returns the external files (relative to `root`).
    `proto`: the model already read (without external data)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors

    proto = read_onnx(onnx_path) if proto is None else proto
    base = onnx_path.parent.resolve()
    found: list[str] = []
    for t in _get_all_tensors(proto):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        loc = ExternalDataInfo(t).location
        target = (base / loc).resolve()
        if Path(loc).is_absolute() or not target.is_relative_to(root.resolve()):
            raise XDeployError(f"{onnx_path.name}: external data {loc!r} of tensor {t.name!r} points outside "
                               "the artifact directory")
        if not target.is_file():
            raise XDeployError(f"{onnx_path.name}: external data file {loc!r} of tensor {t.name!r} is missing")
        rel = target.relative_to(root.resolve()).as_posix()
        if rel not in found:
            found.append(rel)
    return found



# ------------------------------------------------------------------------------------------ finding ----

def graph_file(path: Path) -> tuple[Path, str]:
    """(view root, graph file relative to it) of an ONNX file or a directory holding one: the directory's
    model.onnx, onnx/model.onnx, or its only .onnx file. The root of <dir>/onnx/model.onnx is <dir> when that
    holds the export's config or tokenizer (Optimum / sentence-transformers)."""
    if path.is_file():
        if path.suffix.lower() != ".onnx":
            raise XDeployError(f"{path} is a file, not an artifact directory or an ONNX (.onnx) file")
        f = path.resolve()
        root = f.parent
        if root.name == "onnx" and any((root.parent / n).is_file() for n in ("config.json", "tokenizer.json",
                                                                             "modules.json")):
            root = root.parent
        return root, f.relative_to(root).as_posix()
    if not path.is_dir():
        raise XDeployError(f"{path} does not exist; expected an artifact directory, an ONNX file or a directory "
                           "holding one")
    for rel in GRAPH_FILES:
        if (path / rel).is_file():
            return path.resolve(), rel
    found = sorted(p.relative_to(path).as_posix() for p in [*path.glob("*.onnx"), *path.glob("onnx/*.onnx")])
    if len(found) == 1:
        return path.resolve(), found[0]
    if not found:
        raise XDeployError(f"{path} is not an xdeploy artifact: it has no manifest.json and no .onnx file")
    raise XDeployError(f"{path} holds {len(found)} ONNX files ({', '.join(found[:6])}) and no model.onnx; "
                       "give the file to use")


def _read_config(root: Path) -> dict[str, Any]:
    """config.json beside the graph (untrusted: anything but a JSON object reads as empty)."""
    p = root / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    return data if isinstance(data, dict) else {}


def _pos_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# ------------------------------------------------------------------------------------------ reading ----

def _canonical(dim: str) -> str | None:
    key = re.sub(r"[\s\-]+", "_", dim.strip().lower())
    return next((axis for axis, names in AXIS_NAMES.items() if key in names), None)


def _kind(name: str, dtype: str) -> str:
    n = name.lower()
    if "mask" in n:
        return "mask"
    if dtype in ("int64", "int32"):
        return "zeros" if any(k in n for k in ("type", "segment", "position", "pos_ids")) else "ids"
    return "zeros" if dtype == "bool" else "float"


def _vocab_from_graph(proto: Any, ids: str) -> int | None:
    """Rows of the embedding table token ids `ids` index: the Gather whose indices come from `ids` (through
    casts and reshapes) and whose data is a 2-D initializer (or one dequantized / cast on the way)."""
    inits = {t.name: t for t in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    reach = {ids}
    for n in proto.graph.node:  # nodes are topologically sorted in a valid graph
        if n.op_type in PASS_OPS and n.input and n.input[0] in reach:
            reach.update(n.output)
    rows = []
    for n in proto.graph.node:
        if n.op_type != "Gather" or len(n.input) < 2 or n.input[1] not in reach:
            continue
        data = n.input[0]
        for _ in range(3):  # DequantizeLinear / Cast of an initializer
            if data in inits or data not in producer or not producer[data].input:
                break
            data = producer[data].input[0]
        if data in inits and len(inits[data].dims) == 2:
            rows.append(int(inits[data].dims[0]))
    return min(rows) if rows else None


def _vocab(proto: Any, ids: str, config: Mapping[str, Any], tokenizer: Path | None) -> tuple[int, str]:
    rows = _vocab_from_graph(proto, ids)
    if rows:
        return rows, "graph (embedding rows)"
    if (v := _pos_int(config.get("vocab_size"))) is not None:
        return v, "config.json vocab_size"
    if tokenizer is not None:
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size(), "tokenizer.json"
        except Exception:  # a malformed tokenizer.json: the view still opens, ids stay small  # noqa: S110
            pass
    return 2, "unknown (ids 0 and 1 only)"


def _precision(proto: Any) -> str:
    ops = {n.op_type for n in proto.graph.node}
    if ops & DYNAMIC_INT8_OPS:
        return "int8-dynamic"
    if ops & QDQ_OPS:
        return "int8"
    import onnx

    sizes = {onnx.TensorProto.FLOAT: 0, onnx.TensorProto.FLOAT16: 0}
    for t in proto.graph.initializer:
        if t.data_type in sizes:
            n = 1
            for d in t.dims:
                n *= d
            sizes[t.data_type] += n
    return "fp16" if sizes[onnx.TensorProto.FLOAT16] > sizes[onnx.TensorProto.FLOAT] else "fp32"


def _dense_params(proto: Any) -> int:
    """Weight elements of the dense layers (MatMul / Gemm with a 2-D initializer operand): FLOPs per token ~ 2x."""
    inits = {t.name: t for t in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    total = 0
    for n in proto.graph.node:
        if n.op_type not in DENSE_OPS:
            continue
        for name in n.input[:2]:
            for _ in range(3):  # DequantizeLinear / Cast / Transpose of an initializer
                if name in inits or name not in producer or not producer[name].input:
                    break
                name = producer[name].input[0]
            if name in inits and len(inits[name].dims) == 2:
                total += int(inits[name].dims[0]) * int(inits[name].dims[1])
                break
    return total


IO = dict[str, tuple[str, tuple[Any, ...]]]  # tensor name -> (dtype, dims: int, dim name or None)


def graph_io(proto: Any, path: Path) -> tuple[IO, IO]:
    """The graph's inputs and outputs as name -> (dtype, dims), read from `proto` (the ONNX file at `path`)."""
    inits = {t.name for t in proto.graph.initializer}
    ins = {n: (dt, tuple(dims)) for n, dt, dims in _tensors(proto.graph.input, inits, "input", path)}
    outs = {n: (dt, tuple(dims)) for n, dt, dims in _tensors(proto.graph.output, inits, "output", path)}
    return ins, outs


def _tensors(values: Sequence[Any], inits: set[str], what: str, path: Path) -> list[tuple[str, str, list[Any]]]:
    """(name, dtype, dims) of graph inputs or outputs; a dim is an int, a dim_param or None (unnamed)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    out = []
    for v in values:
        if v.name in inits:  # old opsets list initializers among the inputs
            continue
        tt = v.type.tensor_type if v.type.HasField("tensor_type") else None
        if tt is None:
            raise XDeployError(f"{path.name}: {what} {v.name!r} is not a tensor; xdeploy runs tensor graphs only")
        try:
            dtype = str(tensor_dtype_to_np_dtype(tt.elem_type))
        except (KeyError, ValueError, TypeError):
            dtype = f"element type {tt.elem_type}"
        if dtype not in DTYPES:
            hint = " (a float64 graph: cast it to float32 first)" if dtype == "float64" else ""
            raise XDeployError(f"{path.name}: {what} {v.name!r} is {dtype}; xdeploy feeds and reads "
                               f"{', '.join(DTYPES)}{hint}")
        if not tt.HasField("shape"):
            raise XDeployError(f"{path.name}: {what} {v.name!r} declares no shape (not even its rank); re-export it "
                               "with shapes")
        dims: list[Any] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param if d.HasField("dim_param") and d.dim_param else None)
        out.append((v.name, dtype, dims))
    return out


def _axes(inputs: list[tuple[str, str, list[Any]]], outputs: list[tuple[str, str, list[Any]]],
          config: Mapping[str, Any]) -> tuple[dict[str, Axis], dict[str, str], list[str], dict[str, list[Any]]]:
    """axes, {axis: the graph's dim name} of the recognized ones, the unrecognized input axes (need --shapes),
    and every tensor's dims in axis names."""
    axes: dict[str, Axis] = {}
    guessed: dict[str, str] = {}
    unbound: list[str] = []
    by_param: dict[str, str] = {}  # the graph's dim_param -> axis name
    dims_of: dict[str, list[Any]] = {}
    max_pos = _pos_int(config.get("max_position_embeddings")) or _pos_int(config.get("n_positions"))
    image = _pos_int(config.get("image_size"))
    for is_input, tensors in ((True, inputs), (False, outputs)):
        for name, _, dims in tensors:
            named: list[Any] = []
            for i, d in enumerate(dims):
                if isinstance(d, int):
                    named.append(d)
                    continue
                if d is not None and d in by_param:
                    named.append(by_param[d])
                    continue
                canon = _canonical(d) if d is not None and is_input else None
                if canon is not None and canon not in axes:
                    axis = canon
                    guessed[axis] = d
                    if canon == "batch":
                        axes[axis] = BATCH
                    elif canon == "seq":
                        axes[axis] = Axis(1, min(SEQ.opt, max_pos or SEQ.max), max_pos or SEQ.max)
                    else:
                        axes[axis] = Axis(image or IMAGE, image or IMAGE, image or IMAGE)
                else:
                    axis = d if d is not None else f"{name}:{i}"
                    if axis in axes or _canonical(axis) is not None:  # never shadow a recognized axis
                        axis = f"{name}:{i}"
                    axes[axis] = ANY
                    if is_input:
                        unbound.append(axis)
                if d is not None:
                    by_param[d] = axis
                named.append(axis)
            dims_of[name] = named
    axes.setdefault("batch", Axis(1, 1, 1))  # bench, parity and calibration size "batch"; a fixed graph has it at 1
    return axes, guessed, unbound, dims_of


def _text_feeds(ins: list[dict[str, Any]], outs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Embedder's feeds (models/spec.py TextFeeds) when the graph reads like a text encoder: one ids input,
    maybe a mask and token types, all (batch, seq), and a float (batch, seq, d) output."""
    two = [t for t in ins if t["dims"] == ["batch", "seq"]]
    ids = [t for t in two if t["kind"] == "ids"]
    if len(ids) != 1 or len(two) != len(ins):
        return None
    hidden = [t for t in outs if t["dtype"] in ("float32", "float16") and len(t["dims"]) == 3
              and t["dims"][:2] == ["batch", "seq"] and isinstance(t["dims"][2], int)]
    if not hidden:
        return None
    pick = next((t for t in hidden if t["name"] == "last_hidden_state"), hidden[0])
    mask = [t["name"] for t in ins if t["kind"] == "mask"]
    types = [t["name"] for t in ins if t["kind"] == "zeros"]
    if len(mask) > 1 or len(types) > 1:
        return None
    return {"ids": ids[0]["name"], "mask": mask[0] if mask else None, "type_ids": types[0] if types else None,
            "hidden": pick["name"]}


def view_manifest(path: Path, *, verify: bool = True) -> tuple[Path, dict[str, Any]]:
    """(root, manifest) of the artifact view of a foreign ONNX file or directory (see the module docstring)."""
    root, rel = graph_file(path)
    gpath = root / rel
    proto = read_onnx(gpath)
    external = check_external_data(gpath, root, proto)
    inits = {t.name for t in proto.graph.initializer}
    ins = _tensors(proto.graph.input, inits, "input", gpath)
    outs = _tensors(proto.graph.output, set(), "output", gpath)
    if not ins or not outs:
        raise XDeployError(f"{gpath.name}: a graph with {len(ins)} input(s) and {len(outs)} output(s); xdeploy runs "
                           "graphs with inputs and outputs")
    config = _read_config(root)
    tok = root if (root / "tokenizer.json").is_file() else None
    axes, guessed, unbound, dims_of = _axes(ins, outs, config)
    inputs, vocab = [], None
    for name, dtype, _ in ins:
        kind = _kind(name, dtype)
        high = 0
        if kind == "ids":
            if vocab is None:
                vocab = _vocab(proto, name, config, tok)
            high = _vocab_from_graph(proto, name) or vocab[0]
        inputs.append({"name": name, "dtype": dtype, "dims": dims_of[name], "kind": kind, "high": high})
    outputs = [{"name": n, "dtype": d, "dims": dims_of[n], "kind": "float", "high": 0} for n, d, _ in outs]
    opset = default_opset(proto)
    if not MIN_OPSET <= opset <= MAX_OPSET:  # else a refusal of the view's own manifest, which the user never wrote
        raise XDeployError(f"{gpath.name}: ONNX opset {opset}; xdeploy runs opsets {MIN_OPSET} to {MAX_OPSET} "
                           f"(onnxruntime's oldest is {MIN_OPSET}): convert it first, e.g. "
                           "onnx.version_converter.convert_version(model, 17)")
    text = _text_feeds(inputs, outputs)
    tok_files = [n for n in TOKENIZER_FILES if tok is not None and (root / n).is_file()]
    files = [rel, *external, *tok_files]
    label = gpath.stem if gpath.stem not in ("model", "onnx") else (root.name or gpath.stem)
    manifest: dict[str, Any] = {
        "model": label, "preset": None, "config": {},
        "precision": _precision(proto), "opset": opset, "attn_impl": None, "optimized": False,
        "graphs": {"model": {"file": rel, "method": "forward", "inputs": inputs, "outputs": outputs}},
        "axes": {k: dataclasses.asdict(a) for k, a in axes.items()},
        "capabilities": {"role": "encoder", "token_axis": "seq" if "seq" in axes else None, "text": text,
                         "decoding": None, "optimizer": None},
        "source": {"kind": "onnx", "path": str(gpath), "sha256": sha256_file(gpath) if verify else ""},
        "files": {f: (sha256_file(root / f) if verify else "") for f in files},
        SECTION: {"graph": rel, "view_of": str(gpath),
                  "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
                  "axis_names": guessed, "unbound": unbound, "tokenizer_dir": "." if tok is not None else None,
                  "vocab": {"size": vocab[0], "from": vocab[1]} if vocab else None,
                  "dense_params": _dense_params(proto)},
    }
    if (root / "modules.json").is_file():
        pooling = _transformer_dir(root)[1]
        if pooling is not None:
            manifest["pooling"] = dataclasses.asdict(pooling)
    return root, manifest
