"""The one place an artifact directory is written (the layout and the manifest schema are in artifact.py).

Both `export()` (onnx_export.py, from PyTorch) and `convert_artifact()` (convert.py, from an fp32 artifact)
write through `write_artifact`, so saving (the ONNX checker, external data past 2 GB), the ONNX
metadata_props, the library versions and the manifest's `files` digests are defined once:

    with write_artifact(out, manifest, force=force) as w:     # manifest: the core fields (model, precision, ...)
        w.save_weights(module.state_dict())                   # reference/model.safetensors
        w.add_graph("model", proto)                           # model.onnx, metadata_props from the manifest
        w.add_file("tokenizer/tokenizer.json", src_path)      # any extra file ...
        w.add_section("calibration", {"samples": 64})         # ... and its own manifest section
    # on leaving the block: versions, export_seconds, files{sha256} stamped; manifest.json written; the
    # directory renamed into place (nothing is left behind if the block raises)

An extra graph that no runner runs (e.g. a tokenizer graph) goes in with `add_onnx(rel, proto)`; it is
listed in `files` (so `load_artifact` checks its digest) and described by the caller's own section.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import onnx

import xdeploy
from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir, atomic_write_bytes, atomic_write_json, sha256_file

from .artifact import FORMAT, MANIFEST, SCHEMA_VERSION, write_manifest_files
from .onnx_graph import TWO_GB, proto_size

# From this size on a graph's weights go to <graph>.onnx.data beside it, not inside the protobuf: onnxruntime then
# maps that file instead of parsing a copy of every weight out of the model bytes and keeping it (GPT-2 small
# fp32 decode on `ort`, generating: peak RSS 1146 -> 877 MB on Zen 3, same tokens/s), and protobuf's 2 GB limit
# never applies. Small graphs (tiny presets) stay one file.
EXTERNAL_DATA_BYTES = 32 * 2**20
# Manifest keys the writer and the artifact loader own; a caller's extra section must pick another name.
CORE_KEYS = frozenset({
    "format", "schema_version", "model", "preset", "source", "config", "precision", "opset", "attn_impl",
    "optimized", "graphs", "axes", "tolerances", "conversion", "pooling", "derived_from", "versions",
    "export_seconds", "files", "capabilities", "cost",
})
# Core manifest fields mirrored into every graph's metadata_props (as "xdeploy.<key>").
METADATA_KEYS = ("model", "preset", "precision", "opset", "optimized", "schema_version")


def set_metadata(proto: onnx.ModelProto, fields: Mapping[str, Any]) -> None:
    """Mirror key manifest fields into metadata_props, for runtimes that only see the .onnx file."""
    del proto.metadata_props[:]
    for k, v in fields.items():
        proto.metadata_props.add(key=f"xdeploy.{k}", value=str(v))
    proto.producer_name, proto.producer_version = "xdeploy", xdeploy.__version__


def save_onnx(proto: onnx.ModelProto, path: Path, *, check: bool = True) -> None:
    """Check fully (with shape inference) and save; weights go to <name>.data from EXTERNAL_DATA_BYTES on."""
    size = proto_size(proto)  # an upper estimate: a graph within a few KB of a threshold is treated as over
    large = size >= EXTERNAL_DATA_BYTES
    try:
        if check and size < TWO_GB:
            onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as e:
        raise XDeployError(f"graph {path.name} failed the ONNX checker: {str(e).splitlines()[0]}") from e
    if large:  # onnx moves the weights of the proto it saves out to the file: keep the caller's intact
        saved = onnx.ModelProto()
        saved.CopyFrom(proto)
        proto = saved
    onnx.save_model(proto, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data" if large else None)
    if check and size >= TWO_GB:
        onnx.checker.check_model(str(path), full_check=True)


def library_versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """Versions of the libraries an artifact depends on; `extra` names more installed distributions
    (e.g. "nncf", "onnxruntime-extensions") whose version a section relies on."""
    import numpy
    import onnxruntime

    # torch's version from the installed distribution unless torch is already imported: `xdeploy convert` needs
    # no torch, and importing it only to read its version cost ~3 s of CPU per conversion (same string: 2.13.0+cpu)
    torch = sys.modules.get("torch")
    torch_version = torch.__version__ if torch is not None else importlib_metadata.version("torch")
    versions = {"xdeploy": xdeploy.__version__, "python": platform.python_version(), "torch": torch_version,
                "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}
    for dist in extra:
        try:
            versions[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            raise XDeployError(f"cannot record the version of {dist!r}: it is not installed") from None
    return versions


def graph_metadata(manifest: Mapping[str, Any], graph: str) -> dict[str, Any]:
    """The metadata_props of graph `graph`: core manifest fields, the source digest and the graph's I/O."""
    source = manifest.get("source") or {}
    g = manifest["graphs"][graph]
    return ({k: ("" if manifest.get(k) is None else manifest[k]) for k in METADATA_KEYS}
            | {"source_sha256": source.get("sha256", source.get("weights_sha256", "")), "graph": graph,
               "inputs": ",".join(t["name"] for t in g["inputs"]),
               "outputs": ",".join(t["name"] for t in g["outputs"])})


class ArtifactWriter:
    """Writes into the temporary directory `root` of one artifact; `write_artifact` makes and finishes it."""

    def __init__(self, root: Path, manifest: Mapping[str, Any], *, out: Path | None = None) -> None:
        missing = [k for k in ("model", "config", "precision", "opset", "graphs", "axes") if k not in manifest]
        if missing:
            raise ValueError(f"artifact manifest lacks core field(s) {missing}")
        self.root, self.out = root, out or root
        self.manifest: dict[str, Any] = {"format": FORMAT, "schema_version": SCHEMA_VERSION} | dict(manifest)
        self._versions: list[str] = []
        self._written: set[str] = set()
        self._t0 = time.perf_counter()

    def path(self, rel: str) -> Path:
        """The temporary path of `rel` (a relative path inside the artifact), its folder created."""
        p = (self.root / rel).resolve()
        if Path(rel).is_absolute() or not p.is_relative_to(self.root.resolve()) or p == self.root.resolve():
            raise XDeployError(f"artifact file {rel!r} must be a relative path inside the artifact")
        if rel == MANIFEST:
            raise XDeployError(f"{MANIFEST} is written by the writer itself")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def save_weights(self, state: Mapping[str, Any]) -> str:
        """reference/model.safetensors from a torch state dict; returns its sha256."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        p = self.path("reference/model.safetensors")
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, str(p))
        except SafetensorError as e:  # e.g. a full disk: not an OSError, so say it here
            raise XDeployError(f"cannot write {self.out}: {e}") from None
        return sha256_file(p)

    def add_graph(self, name: str, proto: onnx.ModelProto) -> Path:
        """Save graph `name` (declared in manifest["graphs"]) with its metadata_props."""
        if name not in self.manifest["graphs"]:
            raise ValueError(f"graph {name!r} is not declared in the manifest's graphs")
        set_metadata(proto, graph_metadata(self.manifest, name))
        p = self.path(self.manifest["graphs"][name]["file"])
        save_onnx(proto, p)
        self._written.add(name)
        return p

    def add_onnx(self, rel: str, proto: onnx.ModelProto, *, check: bool = True) -> Path:
        """An extra ONNX file no runner loads as a graph (e.g. a tokenizer graph); `check=False` skips the
        ONNX checker for graphs of custom-op domains it cannot infer."""
        p = self.path(rel)
        save_onnx(proto, p, check=check)
        return p

    def add_file(self, rel: str, content: bytes | str | Path) -> Path:
        """An extra file: bytes/str are written (atomically), a Path is copied."""
        p = self.path(rel)
        if isinstance(content, Path):
            shutil.copy2(content, p)
        else:
            atomic_write_bytes(p, content.encode("utf-8") if isinstance(content, str) else content)
        return p

    def add_section(self, key: str, value: Any, *, versions: Iterable[str] = ()) -> None:
        """A manifest section of the caller's own (JSON-serializable), and the distributions whose versions
        it depends on. Core keys and an existing section are refused, so two writers cannot clash."""
        if key in CORE_KEYS or key in self.manifest:
            raise ValueError(f"manifest section {key!r} is a core field or already written")
        self.manifest[key] = value
        self._versions.extend(versions)

    def finish(self) -> dict[str, Any]:
        missing = sorted(set(self.manifest["graphs"]) - self._written)
        if missing:
            raise ValueError(f"graphs declared but not written: {missing}")
        m = self.manifest
        m["versions"] = library_versions(self._versions)
        m["export_seconds"] = round(time.perf_counter() - self._t0, 3)
        write_manifest_files(self.root, m)
        atomic_write_json(self.root / MANIFEST, m)
        return m


@contextlib.contextmanager
def write_artifact(out: str | Path, manifest: Mapping[str, Any], *, force: bool = False) -> Iterator[ArtifactWriter]:
    """Write one artifact atomically: yields an `ArtifactWriter` over a temporary directory; when the block
    ends the manifest is completed and written and the directory renamed to `out`."""
    with atomic_dir(out, force=force) as tmp:
        w = ArtifactWriter(tmp, manifest, out=Path(out))
        yield w
        w.finish()


def write_manifest_beside(root: Path, manifest: Mapping[str, Any]) -> Path:
    """manifest.json for graph files that are already in `root` (a foreign graph's directory, export/foreign.py
    `write_manifest`): the library versions and the sha256 of the files it lists stamped as `finish` does, written
    atomically; nothing else in `root` is touched."""
    m = dict(manifest)
    m["versions"] = library_versions()
    m["files"] = {rel: sha256_file(root / rel) for rel in m["files"]}
    atomic_write_json(root / MANIFEST, m)
    return root / MANIFEST
