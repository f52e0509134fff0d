"""The artifact directory: what `xdeploy export` writes and every runner loads.

    <dir>/manifest.json             what the artifact holds (schema below), with a sha256 of every file
    <dir>/<graph>.onnx              one ONNX file per graph (model.onnx; decode.onnx / encoder.onnx for
                                    KV-cache decoding), weights external in <graph>.onnx.data when > 2 GB
    <dir>/reference/model.safetensors  the PyTorch weights the graphs were exported from (torch runner, parity)
    <dir>/tokenizer/*               tokenizer files when the source checkpoint has them

Manifests and ONNX files are untrusted input: `load_artifact` checks the schema, types, that every listed
file lies inside the directory, and (by default) every sha256 before a runner touches them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import sha256_file
from xdeploy.models.spec import (
    ARTIFACT_PRECISIONS,
    DEFAULT_TOLERANCES,
    DTYPES,
    Axis,
    Capabilities,
    Cost,
    DecoderFeeds,
    ExportSpec,
    Graph,
    TensorSpec,
    Tolerance,
    Vocabulary,
    token_axes,
)

from .onnx_graph import IO, MAX_OPSET, MIN_OPSET, check_external_data, graph_io, read_onnx, view_manifest
from .openvino_ir import IR_WEIGHTS

FORMAT = "xdeploy-artifact"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED = ("format", "schema_version", "model", "config", "precision", "opset", "graphs", "axes", "files")

SUPPORTED_OPSETS = (18, 23)  # 18: attention as MatMul/Softmax; 23: the native ONNX Attention op
DEFAULT_OPSET = 23  # by measurement (python -m xdeploy.studies.export_lowering; docs/export.md)
DEFAULT_OPTIMIZE = False  # by measurement, and fused com.microsoft ops would tie the artifact to onnxruntime
# (defined here, not in onnx_export.py, which imports torch: `xdeploy convert` and --help screens need no torch)


@dataclass(frozen=True)
class Artifact:
    """A loaded, validated artifact. `manifest` is the raw dict; the rest are parsed views of it."""

    path: Path
    manifest: Mapping[str, Any]
    model: str
    precision: str
    opset: int
    spec: ExportSpec  # graphs/axes/tolerances as exported (may differ from the code's current defaults)

    def onnx_path(self, graph: str = "model") -> Path:
        return self.path / self.manifest["graphs"][self.graph(graph).name]["file"]

    def graph(self, name: str = "model") -> Graph:
        try:
            return self.spec.graph(name)
        except KeyError:
            raise XDeployError(f"artifact {self.path} has no graph {name!r}; it has: "
                               f"{', '.join(g.name for g in self.spec.graphs)}") from None

    @property
    def config(self) -> Any:
        """The model's config dataclass (imports the torch-based model registry; the ONNX path does not)."""
        return parse_config(self.model, self.manifest["config"], self.path / MANIFEST)

    @property
    def vocabulary(self) -> Vocabulary:
        """The token facts the decoding loop reads (vocabulary size, positions, special ids), from the manifest's
        config without the model registry: generation from an artifact needs no torch."""
        return _vocabulary(self.manifest["config"], self.capabilities.role, self.path / MANIFEST)

    @property
    def cost(self) -> Cost | None:
        """FLOPs per call as the manifest records them (models/spec.py Cost; checked at load), or None for an
        artifact written before that section (the model registry's `flops` then, which needs torch)."""
        c = self.manifest.get("cost")
        return None if c is None else Cost.from_json(c)

    @property
    def capabilities(self) -> Capabilities:
        """What the model can do and the feed names its drivers need (the manifest's "capabilities"; artifacts
        written before that section existed fall back to the model registry, which needs torch)."""
        mpath = self.path / MANIFEST
        if "capabilities" in self.manifest:
            try:
                return Capabilities.from_json(self.manifest["capabilities"])
            except (TypeError, ValueError) as e:
                raise XDeployError(f"invalid manifest {mpath}: capabilities: {e}") from None
        try:
            from xdeploy.models.registry import get_family
        except ImportError:
            raise XDeployError(f"{mpath} has no capabilities section (an older artifact); re-export it") from None
        try:
            return get_family(self.model).capabilities
        except XDeployError as e:
            raise XDeployError(f"invalid manifest {mpath}: {e}") from None

    @property
    def foreign(self) -> Mapping[str, Any] | None:
        """The "foreign" section of a graph another exporter made (export/foreign.py), or None for ours."""
        return self.manifest.get("foreign")

    @property
    def location(self) -> Path:
        """What `load_artifact` re-opens this artifact from (a child process does): its directory, or the graph
        file of a foreign view (whose directory may hold several)."""
        view_of = (self.foreign or {}).get("view_of")
        return Path(view_of) if isinstance(view_of, str) else self.path

    @property
    def tokenizer_dir(self) -> Path | None:
        rel = (self.foreign or {}).get("tokenizer_dir", "tokenizer")
        d = self.path / rel if isinstance(rel, str) else None
        return d if d is not None and (d / "tokenizer.json").exists() else None

    @property
    def tokenizer_graph(self) -> Path | None:
        """tokenizer/tokenizer.onnx (export --tokenizer-graph), checked at load; None when the artifact has none."""
        rec = self.manifest.get("tokenizer_graph")
        return self.path / rec["file"] if rec else None

    def openvino_ir(self, graph: str = "model") -> Path | None:
        """openvino/<graph>.xml converted from the reference module (export openvino_ir=True; in a static int8
        artifact: quantized by NNCF, export/convert.py), checked at load; None when the artifact carries no IR
        for the graph."""
        rec = (self.manifest.get("openvino") or {}).get("graphs", {}).get(self.graph(graph).name)
        return self.path / rec["xml"] if rec else None

    def openvino_stateful(self, graph: str) -> Mapping[str, Any] | None:
        """The stateful IR that replaces `graph` in a decoding loop (export/openvino_ir.py `stateful_ir`: the KV
        cache kept in the engine) as its manifest record (xml, mask, beam, variables), checked at load; None when
        the artifact carries none for that graph."""
        rec = (self.manifest.get("openvino") or {}).get("stateful")
        return rec if rec and rec["replaces"] == self.graph(graph).name else None

    @property
    def tolerance(self) -> Tolerance:
        return self.spec.tolerances[self.precision]


def _ir_files(root: Path, g: Mapping[str, Any], files: Mapping[str, str], mpath: Path) -> None:
    """An IR record's xml and bin: inside the artifact, listed in files, the bin beside its xml."""
    for key, suffix in (("xml", ".xml"), ("bin", ".bin")):
        rel = g.get(key)
        _inside(root, rel, mpath)
        _need(rel.endswith(suffix) and rel in files, mpath,
              f"openvino {key} {rel!r} must be a {suffix} file listed in files")
    _need(g["bin"] == g["xml"].removesuffix(".xml") + ".bin", mpath,
          "openvino bin must sit beside its xml (OpenVINO reads <name>.bin next to <name>.xml)")


def _tensor_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "dims": list(t.dims), "kind": t.kind, "high": t.high} \
        | ({"last_of": t.last_of} if t.last_of else {})


def spec_to_json(spec: ExportSpec, files: Mapping[str, str]) -> tuple[dict, dict, dict]:
    graphs = {g.name: {"file": files[g.name], "method": g.method,
                       "inputs": [_tensor_json(t) for t in g.inputs],
                       "outputs": [_tensor_json(t) for t in g.outputs],
                       **({"decode_step": True} if g.decode_step else {})} for g in spec.graphs}
    axes = {k: dataclasses.asdict(a) for k, a in spec.axes.items()}
    tols = {k: dataclasses.asdict(t) for k, t in spec.tolerances.items()}
    return graphs, axes, tols


def write_manifest_files(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Fill manifest["files"] with the sha256 of every file under root (except the manifest itself)."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(root).as_posix()] = sha256_file(p)
    manifest["files"] = files
    return manifest


# ---------------------------------------------------------------- reading (untrusted) ----

def parse_config(model: str, config: Mapping[str, Any], mpath: Path) -> Any:
    from xdeploy.models.registry import get_family

    try:
        family = get_family(model)
    except XDeployError as e:
        raise XDeployError(f"invalid manifest {mpath}: {e}") from None
    cfg_cls = family.config_type
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    _need(set(config) <= fields, mpath,
          f"config has fields a {model} config does not know: {sorted(set(config) - fields)}")
    hints = typing.get_type_hints(cfg_cls)
    for k, v in config.items():  # a string where an int belongs failed deep in a decode loop, not here
        _need(_of_type(v, hints.get(k)), mpath, f"config field {k!r} is {v!r}; expected {_type_name(hints.get(k))}")
    try:
        return cfg_cls(**config)
    except (TypeError, ValueError) as e:
        raise XDeployError(f"invalid manifest {mpath}: config: {e}") from None


def _vocabulary(config: Mapping[str, Any], role: str, mpath: Path) -> Vocabulary:
    try:
        return Vocabulary.from_config(config, role)
    except ValueError as e:
        raise XDeployError(f"invalid manifest {mpath}: {e}") from None


def _check_io(g: Graph, io: tuple[IO, IO], mpath: Path) -> None:
    """The manifest's tensors of graph `g` are its ONNX graph's: the same names, dtypes and ranks, and every dim the
    ONNX graph fixes fixed alike (the decoding loop sizes its cache, the probes their masks and the runners check
    feeds from the manifest, not the graph). A dim the manifest fixes where the graph has a name only narrows
    what is fed."""
    for declared, actual, what in ((g.inputs, io[0], "inputs"), (g.outputs, io[1], "outputs")):
        want = {t.name: (t.dtype, len(t.dims)) for t in declared}
        have = {n: (dt, len(dims)) for n, (dt, dims) in actual.items()}
        _need(want == have, mpath, f"graph {g.name!r} {what} {_io_text(want)} differ from its ONNX file's "
              f"{_io_text(have)}")
        for t in declared:
            for i, (mine, theirs) in enumerate(zip(t.dims, actual[t.name][1])):
                _need(not _is_int(theirs) or mine == theirs, mpath, f"graph {g.name!r} {what[:-1]} {t.name!r} dim {i} "
                      f"is {mine!r} in the manifest, {theirs} in its ONNX file")


def _io_text(io: Mapping[str, tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{n} {dt} rank {r}" for n, (dt, r) in io.items()) + "]"


def _check_decoding(d: DecoderFeeds, graphs: Mapping[str, Graph], mpath: Path) -> None:
    """The decoding loop's feed names must be tensors of the artifact's graphs: a name that is not failed deep in
    a decode step (a KeyError), not here. What every mode feeds is checked (models/spec.py DecoderFeeds: a
    decoder whose prompt is a step of the decode graph has no separate prefill inputs); a graph the artifact
    does not hold is not checked (it cannot decode, and says so when asked to)."""
    sep = d.prefill_graph != d.decode_graph
    want = {d.decode_graph: ([d.step_ids, d.positions, d.cache_mask, d.step_mask, d.memory], [d.logits, d.new_kv]),
            d.full_graph: ([d.prompt_ids, d.prompt_mask, d.target_ids, d.target_mask], [d.logits])}
    if sep:  # the encoder, or a decoder's own prefill graph
        want[d.prefill_graph] = ([d.prompt_ids, d.prompt_mask], [d.memory])
    for name, (inputs, outputs) in want.items():
        if name not in graphs:
            continue
        have_in, have_out = {t.name for t in graphs[name].inputs}, {t.name for t in graphs[name].outputs}
        for n, have, what in [(n, have_in, "take") for n in inputs] + [(n, have_out, "give") for n in outputs]:
            _need(n is None or n in have, mpath, f"capabilities: decoding names {n!r}, which graph {name!r} does "
                  f"not {what} (it {what}s {', '.join(sorted(have))})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _of_type(v: Any, hint: Any) -> bool:
    """Whether JSON value `v` fits a config field annotated `hint` (int, float, str, bool, None and unions of
    them; an int is a float; any other annotation is not checked here)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_of_type(v, h) for h in typing.get_args(hint))
    if hint is type(None):
        return v is None
    if hint is int:
        return _is_int(v)
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint in (str, bool):
        return isinstance(v, hint)
    return True


def _type_name(hint: Any) -> str:
    return " or ".join("null" if h is type(None) else getattr(h, "__name__", str(h))
                       for h in (typing.get_args(hint) or (hint,)))


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise XDeployError(f"invalid manifest {path}: {what}")


def _inside(root: Path, rel: Any, mpath: Path) -> Path:
    _need(isinstance(rel, str) and rel != "", mpath, f"file name {rel!r} is not a non-empty string")
    p = (root / rel).resolve()
    _need(p.is_relative_to(root.resolve()) and not Path(rel).is_absolute(), mpath,
          f"file {rel!r} points outside the artifact directory")
    return p


def _parse_tensor(d: Any, mpath: Path) -> TensorSpec:
    _need(isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("dims"), list), mpath,
          f"tensor entry {d!r} needs a name and dims")
    _need(d.get("dtype") in DTYPES, mpath,
          f"tensor {d.get('name')!r} has unsupported dtype {d.get('dtype')!r}")
    dims = d["dims"]
    _need(all(isinstance(x, str) or (_is_int(x) and x > 0) for x in dims),
          mpath, f"tensor {d['name']!r} dims must be axis names or positive ints")
    high = d.get("high", 0)
    _need(_is_int(high) and high >= 0, mpath, f"tensor {d['name']!r} has a bad 'high'")
    last_of = d.get("last_of", "")
    _need(isinstance(last_of, str), mpath, f"tensor {d['name']!r} has a bad 'last_of'")
    return TensorSpec(d["name"], d["dtype"], tuple(dims), str(d.get("kind", "float")), high, last_of)


def load_artifact(path: str | Path, *, verify: bool = True) -> Artifact:
    """Load and validate an artifact directory; `verify` also checks every file's sha256. A plain ONNX file, or a
    directory of another exporter's (no manifest.json: Optimum, sentence-transformers, torch.onnx.export), is
    wrapped in an artifact view on the fly (export/foreign.py); nothing is written beside it."""
    root = Path(path)
    mpath = root / MANIFEST
    if root.is_file() or (root.is_dir() and not mpath.exists()):
        root, m = view_manifest(root, verify=verify)
        return parse_manifest(root, {"format": FORMAT, "schema_version": SCHEMA_VERSION} | m, root / MANIFEST,
                              verify=False)
    if not root.exists():
        raise XDeployError(f"{root} does not exist; expected an artifact directory, an ONNX file or a directory "
                           "holding one")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise XDeployError(f"{root} is not an xdeploy artifact: it has no {MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XDeployError(f"invalid manifest {mpath}: not JSON ({e})") from None
    return parse_manifest(root, m, mpath, verify=verify)


def parse_manifest(root: Path, m: Any, mpath: Path, *, verify: bool = True) -> Artifact:
    """Validate manifest `m` of the artifact at `root` (untrusted: from manifest.json, or built from a foreign
    graph) and return the Artifact; `verify` also checks every file's sha256 and the graphs' external data."""
    _need(isinstance(m, dict), mpath, "not a JSON object")
    missing = [k for k in REQUIRED if k not in m]
    _need(not missing, mpath, f"missing field(s): {', '.join(missing)}")
    _need(isinstance(m["format"], str) and m["format"] == FORMAT, mpath,
          f"format is {m['format']!r}, expected {FORMAT!r}")
    _need(_is_int(m["schema_version"]) and m["schema_version"] == SCHEMA_VERSION, mpath,
          f"schema_version {m['schema_version']!r}; this xdeploy reads version {SCHEMA_VERSION}")
    _need(_is_int(m["opset"]) and MIN_OPSET <= m["opset"] <= MAX_OPSET, mpath,
          f"opset {m['opset']!r} out of range ({MIN_OPSET} to {MAX_OPSET})")
    _need(isinstance(m["precision"], str) and m["precision"] in ARTIFACT_PRECISIONS, mpath,
          f"precision {m['precision']!r} unknown")
    _need(isinstance(m["model"], str) and isinstance(m["config"], dict), mpath,
          "model must be a name and config an object")

    files = m["files"]
    _need(isinstance(files, dict) and all(isinstance(v, str) for v in files.values()), mpath,
          "files must map names to sha256 strings")
    for rel in files:
        _inside(root, rel, mpath)

    _need(isinstance(m["axes"], dict) and m["axes"], mpath, "axes must be a non-empty object")
    axes = {}
    for k, a in m["axes"].items():
        vals = [a.get(f) for f in ("min", "opt", "max")] if isinstance(a, dict) else [None]
        _need(all(_is_int(v) for v in vals), mpath, f"axis {k!r} needs integer min, opt, max")
        try:
            axes[k] = Axis(*vals)
        except ValueError as e:
            raise XDeployError(f"invalid manifest {mpath}: axis {k!r}: {e}") from None
    graphs = []
    _need(isinstance(m["graphs"], dict) and "model" in m["graphs"], mpath, "graphs must include 'model'")
    for name, g in m["graphs"].items():
        _need(isinstance(g, dict) and isinstance(g.get("inputs"), list) and isinstance(g.get("outputs"), list),
              mpath, f"graph {name!r} needs inputs and outputs lists")
        f = _inside(root, g.get("file"), mpath)
        _need(g["file"] in files, mpath, f"graph file {g['file']!r} is not listed in files")
        _need(f.exists(), mpath, f"graph file {g['file']!r} is missing")
        ins = tuple(_parse_tensor(t, mpath) for t in g["inputs"])
        outs = tuple(_parse_tensor(t, mpath) for t in g["outputs"])
        for t in ins + outs:
            unknown = [d for d in t.dims if isinstance(d, str) and d not in axes]
            _need(not unknown, mpath, f"tensor {t.name!r} uses undeclared axis {unknown[:1]}")
        names = [t.name for t in ins]
        _need(len(set(names)) == len(names) and ins, mpath, f"graph {name!r} inputs must be non-empty and unique")
        _need(isinstance(g.get("decode_step", False), bool), mpath, f"graph {name!r} decode_step must be true/false")
        graphs.append(Graph(name, str(g.get("method", "forward")), ins, outs, bool(g.get("decode_step", False))))
    tols = dict(DEFAULT_TOLERANCES)
    extra_tols = m.get("tolerances") or {}
    _need(isinstance(extra_tols, dict), mpath, "tolerances must be an object")
    for k, t in extra_tols.items():
        vals = [t.get(f) for f in ("atol", "rtol", "cosine")] if isinstance(t, dict) else [None]
        _need(all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals),
              mpath, f"tolerance {k!r} needs finite numbers atol, rtol, cosine")
        tols[k] = Tolerance(*(float(v) for v in vals))

    tg = m.get("tokenizer_graph")
    if tg is not None:
        _need(isinstance(tg, dict) and isinstance(tg.get("max_length"), int) and tg["max_length"] >= 2, mpath,
              "tokenizer_graph must be an object with an integer max_length >= 2")
        _inside(root, tg.get("file"), mpath)
        _need(tg["file"] in files, mpath, f"tokenizer graph {tg['file']!r} is not listed in files")
        _need(files[tg["file"]] == tg.get("sha256"), mpath, "tokenizer_graph sha256 differs from its files entry")
    if "capabilities" in m:
        try:
            caps = Capabilities.from_json(m["capabilities"])
        except (TypeError, ValueError) as e:
            raise XDeployError(f"invalid manifest {mpath}: capabilities: {e}") from None
        if caps.decoding is not None:
            _check_decoding(caps.decoding, {g.name: g for g in graphs}, mpath)
            _vocabulary(m["config"], caps.role, mpath)  # a bad token id fails here, not deep in a decode loop

    if m.get("cost") is not None:
        try:
            cost = Cost.from_json(m["cost"])
        except ValueError as e:
            raise XDeployError(f"invalid manifest {mpath}: cost: {e}") from None
        # a term must read a token axis this artifact declares (a benchmark sets those; any other would be a
        # KeyError deep in `xdeploy bench`)
        declared = set(token_axes(caps)) if "capabilities" in m else set(m["axes"])
        odd = sorted({a for mono, _ in cost.terms for a, _ in mono} - declared)
        _need(not odd, mpath, f"cost reads axis {', '.join(map(repr, odd))}; expected token axes among "
                              f"{sorted(declared) or 'none'}")

    ov_ir = m.get("openvino")
    if ov_ir is not None:
        _need(isinstance(ov_ir, dict) and isinstance(ov_ir.get("graphs"), dict), mpath,
              "openvino must be an object with a graphs object")
        # fp32 artifacts carry the reference's IR, fp16 ones the same with fp16 weights, int8-dynamic ones with
        # int8-compressed weights, static int8 ones an NNCF-quantized IR (export/openvino_ir.py, export/convert.py)
        _need(m["precision"] in IR_WEIGHTS and ov_ir.get("weights", "fp32") == IR_WEIGHTS[m["precision"]], mpath,
              f"an OpenVINO IR of {ov_ir.get('weights', 'fp32')} weights in a {m['precision']} artifact")
        for name, g in ov_ir["graphs"].items():
            _need(name in m["graphs"] and isinstance(g, dict), mpath, f"openvino graph {name!r} is not a graph")
            _ir_files(root, g, files, mpath)
        st = ov_ir.get("stateful")
        if st is not None:  # export/openvino_ir.py stateful_ir: the decode step with its KV cache in the engine
            _need(isinstance(st, dict) and st.get("replaces") in m["graphs"]
                  and all(isinstance(st.get(k), str) and st[k] for k in ("mask", "beam", "method"))
                  and isinstance(st.get("variables"), list) and st["variables"]
                  and all(isinstance(v, str) for v in st["variables"]), mpath,
                  "openvino stateful must name the graph it replaces, its mask and beam inputs and its variables")
            _ir_files(root, st, files, mpath)

    if verify:
        for rel, digest in files.items():
            p = root / rel
            if not p.exists():
                raise XDeployError(f"artifact {root} is incomplete: {rel} is missing")
            if sha256_file(p) != digest:
                raise XDeployError(f"artifact {root} is corrupted: sha256 of {rel} does not match the manifest")
        for g in graphs:
            path = root / m["graphs"][g.name]["file"]
            proto = read_onnx(path)
            check_external_data(path, root, proto)
            _check_io(g, graph_io(proto, path), mpath)
    return Artifact(path=root, manifest=m, model=m["model"], precision=m["precision"],
                    opset=m["opset"], spec=ExportSpec(tuple(graphs), axes, tols))
