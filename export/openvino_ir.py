"""An OpenVINO IR converted straight from the reference module, carried beside the ONNX graphs.

    export(model, ..., openvino_ir=True)          # fp32 and fp16 artifacts; openvino/<graph>.xml + .bin

Why: OpenVINO's ONNX frontend keeps the exported graph's layout (per-head Reshape/Transpose around attention,
the dynamo exporter's Transposes around LayerNorm/GELU), and the CPU plugin compiles it to ~4x the Transpose and
~1.6x the Reorder nodes of the same model converted from PyTorch by `openvino.convert_model`. At fp32 that
overhead is noise; at bf16 (AMX / AVX-512 BF16), where the arithmetic gets fast, it is a few percent of the
latency (docs/benchmarks.md, "OpenVINO: ONNX vs IR"). So fp32 artifacts can carry an IR converted from the same
module (same weights, same inputs and outputs, dynamic axes as in the manifest); the `ov` runner compiles it when
present (deploy/ov_runner.py, `format="auto"`), parity checks it like any graph, and every other runtime keeps
reading the ONNX. The IR holds fp32 weights (`compress_to_fp16=False`): the precision the CPU computes in is the
runner's hint, as for the ONNX graph.

An fp16 artifact carries the same IRs with their weights stored as fp16 (`save_model(compress_to_fp16=True)`:
each weight an fp16 Constant and a Convert marked as decompression, the fp16 ONNX graph's rounding). Computing in
f32 (`ov`), the CPU plugin keeps those weights in fp16 where it runs the graph as a language model (a stateful or
PagedAttention step): a decode step then reads half the bytes (docs/generate.md, "fp16 weights").

A static int8 artifact derived from such an fp32 artifact (export/convert.py) may carry an int8 IR: the fp32 IR
quantized by NNCF (`quantize_ir`: OpenVINO's own post-training quantizer, FakeQuantize on the MatMul inputs
that the CPU plugin folds into its int8 kernels) from the same calibration samples as the Q/DQ graph. It is
shipped only when a measured check (verify/sensitivity.py `check_int8_ir`) finds it within the int8 tolerance;
otherwise the section says why and the `ov` runner compiles the Q/DQ ONNX graph.

An int8-dynamic artifact may carry the same IRs with their weights compressed to int8 (`nncf.compress_weights`,
INT8_ASYM: per output channel, asymmetric, data-free; what optimum-intel's `OVWeightQuantizationConfig(bits=8)`
and openvino-genai users run): OpenVINO's int8 route. Its weights are rounded by NNCF, not by onnxruntime's
quantizer, so they are not the ONNX graphs' int8 weights; each is checked against the reference (the golden
probes, at the int8 tolerance) on its own runtime. The CPU plugin computes such a layer with its int8 weights and,
by its defaults, activations quantized at run time in groups (`DYNAMIC_QUANTIZATION_GROUP_SIZE`). On GPT-2 small
(AMD Zen 4) the decode step reads ~125 MB instead of ~500 MB (docs/benchmarks.md).

A decoder that declares an engine-cache step (models/spec.py EngineCache: gpt's `step`) also gets
openvino/<decode graph>.stateful.xml: that step converted the same way and made stateful (`stateful_ir`), so
the CPU plugin keeps the KV cache inside the infer request and appends to it in place (its ReadValue -> Concat
-> ScaledDotProductAttention -> Assign fusion). The `ov` runner compiles it for the decoding loop
(deploy/ov_runner.py `stateful`); it replaces the decode graph there, which probes and parity check through it.

The manifest section "openvino" records, per graph, the xml/bin files (their sha256 are in `files`, checked at
load like the ONNX graphs) and the converter's version; an int8 section also the quantizer, its settings, the
calibration data's record and the check (or, per graph, why the IR was left out: "skipped").
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xdeploy.core.deps import import_quietly, installed
from xdeploy.core.errors import XDeployError
from xdeploy.models.spec import EngineCache, ExportSpec, Graph, make_feeds

if TYPE_CHECKING:  # torch is imported where a module is converted: `available()` stays cheap
    from torch import nn

SECTION = "openvino"
FOLDER = "openvino"


def available() -> bool:
    """Whether openvino is installed: an fp32 export writes the IR by default where it can."""
    return installed("openvino")


def nncf_available() -> bool:
    """Whether nncf (OpenVINO's quantizer, the `openvino` extra) is installed: an int8 conversion quantizes the
    fp32 artifact's IR where it can."""
    return installed("nncf")


# nncf.quantize settings of the int8 IR: symmetric int8 activations (PERFORMANCE: zero point 0, the int8 x int8
# kernels of VNNI / AMX-int8) and the transformer scheme (SmoothQuant, no quantizers on the LayerNorm/Softmax
# paths whose int8 error costs accuracy for no speed). NNCF's own overflow fix (7-bit weights) in the first layer
# only, its default, named here and recorded: the other layers keep 8-bit weights, which OpenVINO's CPU plugin
# saturates on x86 without VNNI or AMX exactly as onnxruntime does (tests/test_int8_kernels.py, run as that class in
# tests/test_emulate.py); the ov runner then compiles the artifact's 7-bit Q/DQ graph instead (deploy/ov_runner.py
# `_ir_saturates`). The fix in every layer ("enable") was measured and not taken: all-MiniLM-L6-v2's IR reached a
# worst cosine of 0.945 against 0.971 with the default on its check's hardest case (docs/benchmarks.md).
NNCF_PRESET = "performance"
NNCF_MODEL_TYPE = "transformer"
NNCF_OVERFLOW_FIX = "first_layer_only"


def quantize_ir(xml: str | Path, graph: Graph, samples: Sequence[Mapping[str, np.ndarray]]) -> Any:
    """The fp32 IR at `xml` quantized by `nncf.quantize` on the calibration `samples` (feed dicts; inputs of
    `graph` only, all of them: subset_size = len(samples)). Returns an ov.Model; one XDeployError line when
    nncf is missing or refuses the model."""
    try:
        nncf, ov = import_quietly("nncf"), import_quietly("openvino")
    except ImportError:
        raise XDeployError("an int8 OpenVINO IR needs nncf and openvino: pip install 'xdeploy[openvino]'") from None
    names = [t.name for t in graph.inputs]
    data = [{n: np.asarray(s[n], order="C") for n in names} for s in samples]
    if not data:
        raise XDeployError(f"no calibration samples for graph {graph.name!r}")
    model = ov.Core().read_model(str(xml))
    nncf.set_log_level(logging.ERROR)
    # nncf draws rich progress bars on stdout/stderr: not ours to print
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return nncf.quantize(model, nncf.Dataset(data), preset=nncf.QuantizationPreset(NNCF_PRESET),
                                 model_type=nncf.ModelType(NNCF_MODEL_TYPE), subset_size=len(data),
                                 advanced_parameters=nncf.AdvancedQuantizationParameters(
                                     overflow_fix=nncf.OverflowFix(NNCF_OVERFLOW_FIX)))
        except Exception as e:  # nncf raises assorted types; keep the first line
            raise XDeployError(f"nncf.quantize failed for graph {graph.name!r}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from e


def nncf_version() -> str:
    from importlib import metadata

    return metadata.version("nncf")


def convert_graph_ir(module: nn.Module, graph: Graph, sizes: Mapping[str, int]) -> Any:
    """openvino.convert_model of `module` (one graph's method exposed as forward, as the ONNX exporter sees it;
    traced at the example `sizes`): inputs named and typed as the manifest says, dynamic axes dynamic (fixed dims
    fixed), outputs named as the ONNX graph's. Returns an ov.Model."""
    try:
        ov = import_quietly("openvino")
    except ImportError:
        raise XDeployError("an OpenVINO IR needs the openvino package: pip install 'xdeploy[openvino]'") from None
    import torch

    feeds = make_feeds(graph, sizes, seed=0)
    example = tuple(torch.from_numpy(feeds[t.name]) for t in graph.inputs)
    # positional (the wrapper's forward takes *args): named below, after conversion
    shapes = [(ov.PartialShape([-1 if isinstance(d, str) else d for d in t.dims]), ov.Type(t.dtype))
              for t in graph.inputs]
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            ir = ov.convert_model(module.eval(), example_input=example, input=shapes)
        except Exception as e:  # the frontend raises several types; keep the first line
            raise XDeployError(f"openvino.convert_model failed for graph {graph.name!r}: "
                               f"{str(e).strip().splitlines()[0]}") from e
    if len(ir.outputs) != len(graph.outputs) or len(ir.inputs) != len(graph.inputs):
        raise XDeployError(f"openvino.convert_model gave {len(ir.inputs)} inputs / {len(ir.outputs)} outputs for "
                           f"graph {graph.name!r}; the graph declares {len(graph.inputs)} / {len(graph.outputs)}")
    for port, t in zip(ir.inputs, graph.inputs):
        port.get_tensor().set_names({t.name})
    for port, t in zip(ir.outputs, graph.outputs):
        port.get_tensor().set_names({t.name})
    return ir


def stateful_ir(ir: Any, ec: EngineCache) -> tuple[Any, list[str]]:
    """The converted engine-cache step `ir` with its cache inside, as optimum-intel builds its decoders: a new
    input `ec.beam` (N,) int32 gathers the cached rows before the step (beam search reorders them; a prefill's B
    rows become B x beams), every past input becomes a ReadValue of a variable and its present output an Assign
    (OpenVINO's MakeStateful), and each variable starts as a zero-length cache of the step's batch. Returns the
    model and the variable ids, layer-major (the decode graph's cache order)."""
    ov = import_quietly("openvino")
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = ec.state_pairs()
    beam = opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name=ec.beam)
    beam.output(0).get_tensor().set_names({ec.beam})
    ir.add_parameters([beam])
    for past, _ in pairs:
        port = ir.input(past)
        users = list(port.get_target_inputs())
        picked = opset13.gather(port, beam, opset13.constant(0))  # (N, nh, P, hs): row r continues beam_idx[r]
        for u in users:
            u.replace_source_output(picked.output(0))
    apply_make_stateful_transformation(ir, dict(pairs))
    # the initial value: (batch of the ids, nh, 0, hs) zeros, so a reset request starts every row empty
    spec = {t.name: t for t in ec.graph.inputs}
    ids = ec.graph.inputs[0]
    batch = opset13.gather(opset13.shape_of(ir.input(ids.name), output_type="i64"), opset13.constant([0]),
                           opset13.constant(0))
    variables = []
    by_var = {op.get_variable_id(): op for op in ir.get_ops() if op.get_type_name() == "ReadValue"}
    for past, present in pairs:
        var = next((v for v in by_var if v.startswith(past) and v.endswith(present)), None)
        if var is None:
            raise XDeployError(f"OpenVINO made no state of {past!r} -> {present!r}; found {sorted(by_var)[:2]}")
        dims = [batch if d == ids.dims[0] else opset13.constant(np.array([0 if d == ec.past_axis else d], np.int64))
                for d in spec[past].dims]
        zeros = opset13.broadcast(opset13.constant(0.0, ov.Type.f32), opset13.concat(dims, 0))
        by_var[var].set_arguments([zeros])
        variables.append(var)
    # each input named as its tensor: convert_model names a parameter after the traced argument ("input.1" for
    # position_ids), and OpenVINO's own rewrites find inputs by that name (paged_attention_transformation left
    # the rank-2 position_ids beside the rank-1 one it adds; with the names it converts the step as it does
    # optimum-intel's)
    for param in ir.get_parameters():
        names = param.output(0).get_names()
        if len(names) == 1:
            param.set_friendly_name(next(iter(names)))
    ir.validate_nodes_and_infer_types()
    return ir, variables


# the weights an artifact's IR holds, by the artifact's precision (the manifest's openvino.weights; a static int8
# artifact's IR is NNCF-quantized from the fp32 one, export/convert.py), and the precisions whose IR is converted
# from the module
IR_WEIGHTS = {"fp32": "fp32", "fp16": "fp16", "int8-dynamic": "int8 weight-only", "int8": "int8"}
IR_PRECISIONS = ("fp32", "fp16", "int8-dynamic")
FP16_SOURCE = "weights stored as fp16 (openvino.save_model compress_to_fp16=True)"
INT8_WEIGHTS_MODE = "INT8_ASYM"  # nncf.CompressWeightsMode: per output channel, asymmetric (nncf's int8 default)
INT8_WEIGHTS_SOURCE = f"weights compressed to int8 (nncf.compress_weights {INT8_WEIGHTS_MODE})"
IR_SOURCES = {"fp16": FP16_SOURCE, "int8-dynamic": INT8_WEIGHTS_SOURCE}


def compress_int8_weights(ir: Any) -> Any:
    """`ir` (an ov.Model of fp32 weights) with its weights compressed to int8 by nncf.compress_weights (module
    docstring); one XDeployError line when nncf is missing or refuses the model."""
    try:
        nncf = import_quietly("nncf")
    except ImportError:
        raise XDeployError("an int8-weight OpenVINO IR needs nncf: pip install 'xdeploy[openvino]'") from None
    nncf.set_log_level(logging.ERROR)
    # nncf draws rich tables and progress bars on stdout/stderr: not ours to print
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return nncf.compress_weights(ir, mode=getattr(nncf.CompressWeightsMode, INT8_WEIGHTS_MODE))
        except Exception as e:  # nncf raises assorted types; keep the first line
            raise XDeployError(f"nncf.compress_weights failed: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from e


# How save_model(compress_to_fp16=True) marks the Convert behind each fp16 weight, read back from such an IR: the
# rt_info keys of ov::Decompression and ov::pass::DisableConstantFolding (type-info name + "_" + version). The CPU
# plugin keeps a weight behind a Convert so marked in its stored precision and decompresses it inside its
# FullyConnected / Gather kernels; without the marks it folds the Convert and stores f32 again.
DECOMPRESSION_MARKS = ("decompression_0", "disabled_constant_folding_0")
BF16_WEIGHT_MIN_ELEMENTS = 4096  # smaller f32 constants (biases, LayerNorm scales, shapes) stay f32


def bf16_weights(ov: Any, model: Any, ir: Path | None = None) -> int:
    """Store `model`'s f32 weight constants (>= BF16_WEIGHT_MIN_ELEMENTS) as bf16, rounded to nearest even, each
    behind a Convert to f32 marked as decompression, in place; returns how many. Computing in f32, the CPU plugin
    then keeps those weights in bf16 (half the bytes a memory-bound decode step reads; the arithmetic stays f32),
    as it keeps an fp16 artifact's: the `ov` runner's option weights="bf16" (deploy/ov_runner.py). GPT-2 small's
    stateful step on AMD Zen 4, 2 threads: 10.07 ms against 11.80 ms for OpenVINO's bf16 hint (bf16 arithmetic)
    and 9.90 ms for fp16 weights, the same 65 greedy tokens as f32 (docs/generate.md, "bf16 weights").

    `ir`: the xml `model` was read from. Its weights are then read from the .bin with file reads, a few MB at a
    time, not through the constants' memory map. Why: OpenVINO maps the whole .bin once and the small f32
    constants that stay keep the map alive, so every page read through it stayed resident: GPT-2 small's compiled
    bf16-weight step held 0.80 GiB against 0.35 GiB read this way (Xeon model 207, docs/generate.md)."""
    from openvino import opset13

    layers = _ir_f32_constants(ir) if ir is not None else {}
    count = 0
    with open(ir.with_suffix(".bin"), "rb") if layers else contextlib.nullcontext() as binf:
        for op in model.get_ordered_ops():
            if op.get_type_name() != "Constant" or op.get_element_type() != ov.Type.f32:
                continue
            shape = list(op.get_output_shape(0))
            n = int(np.prod(shape))
            if n < BF16_WEIGHT_MIN_ELEMENTS:
                continue
            t = ov.Tensor(ov.Type.bf16, shape)
            out = np.asarray(t.data).view(np.uint16).reshape(-1)
            where = layers.get(op.get_friendly_name())
            mapped = op.get_data().reshape(-1)  # a view of the map: only the pages indexed below are read
            # the layer of that name holds this constant's numbers (its size, its first and last: a rewrite could
            # reuse a name), else the numbers are read through the map
            if not (where is not None and where[1] == 4 * n and _read_rounded(binf.fileno(), where[0], out)
                    and _bf16_of(mapped[:1]) == out[0] and _bf16_of(mapped[-1:]) == out[-1]):
                round_to_bf16(np.ascontiguousarray(mapped, np.float32).view(np.uint32), out)
            convert = opset13.convert(opset13.constant(t), ov.Type.f32)
            for mark in DECOMPRESSION_MARKS:
                convert.get_rt_info()[mark] = ""
            for target in list(op.output(0).get_target_inputs()):
                target.replace_source_output(convert.output(0))
            count += 1
    model.validate_nodes_and_infer_types()
    return count


BF16_CHUNK = 1 << 20  # elements rounded at a time: full-size temporaries of GPT-2's 154 MB head raised the peak


def round_to_bf16(bits: np.ndarray, out: np.ndarray) -> None:
    """`out` (uint16, `bits`' shape) = the f32 numbers whose bit patterns are `bits` (uint32), rounded to nearest
    even on their upper 16 bits, as the CPU plugin converts (finite numbers: no NaN payloads to keep), BF16_CHUNK
    rows at a time (elementwise: the chunks only bound the temporaries)."""
    for i in range(0, len(bits), BF16_CHUNK):
        u = bits[i:i + BF16_CHUNK]
        out[i:i + BF16_CHUNK] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def _read_rounded(fd: int, offset: int, out: np.ndarray) -> bool:
    """`out` = the len(out) f32 numbers at `offset` of file `fd`, rounded to bf16, BF16_CHUNK at a time; False if
    the file ends first."""
    for i in range(0, len(out), BF16_CHUNK):
        m = min(BF16_CHUNK, len(out) - i)
        raw = os.pread(fd, 4 * m, offset + 4 * i)
        if len(raw) != 4 * m:
            return False
        round_to_bf16(np.frombuffer(raw, np.uint32), out[i:i + m])
    return True


def _bf16_of(a: np.ndarray) -> int:
    out = np.zeros(1, np.uint16)
    round_to_bf16(np.ascontiguousarray(a, np.float32).view(np.uint32), out)
    return int(out[0])


def _ir_f32_constants(xml: Path) -> dict[str, tuple[int, int]]:
    """Each f32 Const layer of an IR: its name -> (offset, size) in the .bin (names seen twice are left out)."""
    import xml.etree.ElementTree as ET

    found: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    try:
        for _, el in ET.iterparse(xml):
            if el.tag == "layer" and el.get("type") == "Const":
                data, name = el.find("data"), el.get("name", "")
                if name in seen:  # ambiguous: neither is read by name
                    found.pop(name, None)
                elif data is not None and data.get("element_type") == "f32":
                    found[name] = (int(data.get("offset", -1)), int(data.get("size", -1)))
                seen.add(name)
                el.clear()
    except (ET.ParseError, ValueError) as e:
        raise XDeployError(f"{xml} is not a readable OpenVINO IR xml (expected Const layers with integer offset and "
                           f"size): {e}") from None
    return {k: v for k, v in found.items() if v[0] >= 0}


def save_ir(ir: Any, path: str | Path, precision: str) -> None:
    """openvino.save_model with the artifact's weights: fp32 as converted, fp16 compressed, int8 compressed by nncf
    for an int8-dynamic artifact (module docstring)."""
    ov = import_quietly("openvino")

    if precision not in IR_PRECISIONS:
        raise XDeployError(f"an OpenVINO IR holds fp32, fp16 or int8-compressed weights (artifacts "
                           f"{', '.join(IR_PRECISIONS)}); this artifact is {precision}")
    if precision == "int8-dynamic":
        ir = compress_int8_weights(ir)
    ov.save_model(ir, str(path), compress_to_fp16=precision == "fp16")


def write_ir(writer: Any, spec: ExportSpec, graph_module: Callable[[Graph], nn.Module],
             sizes: Mapping[str, int]) -> None:
    """Every graph of `spec` as openvino/<graph>.xml + .bin through the artifact writer, and the manifest
    section that points at them (fp32, fp16 and int8-dynamic artifacts: the reference's weights, as fp16 in an fp16
    one, compressed to int8 in an int8-dynamic one). `graph_module(graph)` is the module the ONNX exporter traces
    for that graph (onnx_export passes it, so both formats come from the same wrapper at the same example sizes)."""
    precision = writer.manifest["precision"]
    if precision not in IR_PRECISIONS:
        raise XDeployError(f"an OpenVINO IR is carried by {', '.join(IR_PRECISIONS)} artifacts only (it holds the "
                           f"reference's weights); this artifact is {precision}")
    graphs = {}
    for graph in spec.graphs:
        ir = convert_graph_ir(graph_module(graph), graph, sizes)
        xml = f"{FOLDER}/{graph.name}.xml"
        save_ir(ir, writer.path(xml), precision)
        graphs[graph.name] = {"xml": xml, "bin": xml.removesuffix(".xml") + ".bin"}
    source = "openvino.convert_model(reference module)"
    section: dict[str, Any] = {"graphs": graphs, "weights": IR_WEIGHTS[precision],
                               "source": source + ("; " + IR_SOURCES[precision] if precision in IR_SOURCES else "")}
    ec = spec.engine_cache
    if ec is not None:
        # P cached positions beside the step's S: the example sizes must differ (else convert_model may fold them)
        step = ec.graph.inputs[0].dims[1]  # the ids' token axis (an encoder-decoder's step: one token)
        ex = dict(sizes) | {ec.past_axis: 3, ec.total_axis: (step if isinstance(step, int) else sizes[step]) + 3}
        ir, variables = stateful_ir(convert_graph_ir(graph_module(ec.graph), ec.graph, ex), ec)
        xml = f"{FOLDER}/{ec.replaces}.stateful.xml"
        save_ir(ir, writer.path(xml), precision)
        section["stateful"] = {"replaces": ec.replaces, "method": ec.graph.method, "xml": xml,
                               "bin": xml.removesuffix(".xml") + ".bin", "mask": ec.mask, "beam": ec.beam,
                               "variables": variables}
    writer.add_section(SECTION, section, versions=["openvino"] + (["nncf"] if precision == "int8-dynamic" else []))


def compress_irs(writer: Any, source: Path, section: Mapping[str, Any], precision: str = "fp16") -> dict[str, Any]:
    """The "openvino" `section` of the fp32 artifact at `source` (its graphs' IRs and a stateful step) written
    again through `writer` (the fp16 or int8-dynamic artifact converted from it, export/convert.py) with the
    weights stored as that `precision` stores them (save_ir), at the same relative paths; returns the new
    artifact's section."""
    ov = import_quietly("openvino")

    if precision not in IR_SOURCES:
        raise XDeployError(f"an fp32 IR is compressed for {', '.join(IR_SOURCES)} artifacts; got {precision}")
    core = ov.Core()
    out = dict(section) | {"weights": IR_WEIGHTS[precision],
                           "source": f"the fp32 artifact's IR ({section.get('source', '?')}); {IR_SOURCES[precision]}"}
    records = [*section.get("graphs", {}).values(), *([section["stateful"]] if section.get("stateful") else [])]
    for rec in records:
        save_ir(core.read_model(str(source / rec["xml"])), writer.path(rec["xml"]), precision)
    return out
