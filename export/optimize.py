"""Offline graph optimization of exported graphs: onnxruntime's graph optimizer plus its transformer fusions.

`optimize` runs `onnxruntime.transformers.optimizer.optimize_model`: with `level` > 0 onnxruntime's own
offline optimizations run first (constant folding, redundant-node removal; level 2 adds its C++ fusions),
then the Python transformer fusions (Attention/MultiHeadAttention, SkipLayerNormalization, BiasGelu/FastGelu,
EmbedLayerNormalization) are matched on the result.

What fires depends on the lowering (measured on these models, see docs/export.md):
  * opset 18 (attention decomposed into MatMul/Softmax by the dynamo exporter): SkipLayerNormalization,
    BiasGelu/FastGelu and EmbedLayerNormalization fire; the Attention fusion does NOT -- its patterns match
    the graphs of the older TorchScript exporter, not the dynamo exporter's.
  * opset 23 (native ONNX `Attention`): the attention is already one op; the fusions that need symbolic shape
    inference (SkipLayerNormalization) miss because that inference does not know the opset-23 Attention op.

Fused ops live in the `com.microsoft` domain: an optimized graph runs only on onnxruntime (not TensorRT or
OpenVINO), which is why optimization is opt-in (`xdeploy export --optimize`).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import tempfile
from pathlib import Path
from typing import Any

import onnx

from xdeploy.core.errors import XDeployError, ort_reason

from .onnx_graph import TWO_GB, proto_size

MS_DOMAIN = "com.microsoft"
OPT_LEVELS = (0, 1, 2)  # 0: Python fusions only; 1: onnxruntime basic + fusions; 2: + onnxruntime extended


def strip_value_info(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Drop the exporter's intermediate value_info (shape inference recomputes it).

    The dynamo exporter records intermediate shapes from its trace; some disagree with onnx shape inference
    after graph rewrites (quantizer: "Inferred shape and existing shape differ"), and initializer entries
    in value_info make the float16 converter insert duplicate Cast nodes."""
    del proto.graph.value_info[:]
    return proto


def fused_op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    """Node counts of onnxruntime's contrib (fused) ops, e.g. {"SkipLayerNormalization": 4}. Counting by
    domain matters: the native opset-23 `Attention` shares its name with com.microsoft.Attention."""
    c = collections.Counter(n.op_type for n in proto.graph.node if n.domain == MS_DOMAIN)
    return dict(sorted(c.items()))


def optimize(proto: onnx.ModelProto, *, model_type: str, num_heads: int, hidden_size: int, level: int = 1
             ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Return the optimized graph and its fused-op counts. Inputs/outputs (names, dtypes) are unchanged.

    `model_type` is the onnxruntime.transformers optimizer type a model family declares
    (`Capabilities.optimizer`): which fusion patterns (and attention layouts) to try."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import MODEL_TYPES, optimize_model

    if model_type not in MODEL_TYPES:
        raise XDeployError(f"no onnxruntime fusion patterns for optimizer type {model_type!r}; expected one of: "
                           f"{', '.join(MODEL_TYPES)}")
    if level not in OPT_LEVELS:
        raise XDeployError(f"optimization level {level!r}; expected one of: {', '.join(map(str, OPT_LEVELS))}")
    strip_value_info(proto)
    fusion = FusionOptions(model_type)
    if any(n.op_type == "Gelu" and any(a.name == "approximate" and a.s == b"tanh" for a in n.attribute)
           for n in proto.graph.node):
        # The BiasGelu fusion turns Add + Gelu(approximate="tanh") (opset >= 20, GPT-2's gelu) into the *erf*
        # BiasGelu, silently changing the function (measured: 1.4e-3 max abs on gpt-tiny logits, 1.5e-2 on
        # gpt-small): keep those Gelus as they are.
        fusion.enable_bias_gelu = False
    # The optimizer logs every fusion pass (and "failed in shape inference" at opset 23) to stdout/logging.
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    large = proto_size(proto) >= TWO_GB
    with tempfile.TemporaryDirectory(prefix="xdeploy-opt-") as d, contextlib.redirect_stdout(io.StringIO()):
        # Given a ModelProto, the optimizer saves it with external data for its onnxruntime pass, which then
        # cannot constant-fold shape tensors ("Cannot parse data from external tensors"): give it a file.
        src = Path(d, "in.onnx")
        onnx.save_model(proto, str(src), save_as_external_data=large, location="in.onnx.data" if large else None)
        try:
            om = optimize_model(str(src), model_type=model_type, num_heads=num_heads,
                                hidden_size=hidden_size, opt_level=level, use_gpu=False,
                                optimization_options=fusion)
            if large:
                onnx.load_external_data_for_model(om.model, d)
        except Exception as e:  # the optimizer raises assorted types; keep the first line
            raise XDeployError(f"onnxruntime optimizer failed: {ort_reason(e)}") from e
    out = om.model
    out.graph.name = proto.graph.name
    return out, fused_op_counts(out)


def optimize_config(config: Any) -> dict[str, int]:
    """num_heads / hidden_size for `optimize` from a model config (dataclass or manifest dict; every family
    names them alike)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    return {"num_heads": int(get("n_heads")), "hidden_size": int(get("d_model"))}
