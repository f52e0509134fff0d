"""Generation peers: xdeploy's KV-cache decoding against what a user would pick instead, one run (`make peers`).

    .venv-peers/bin/python -m xdeploy.studies.peers_generate --out reports/peers/generate [--quick] [--static-int8]

Workloads (batch 1, greedy, EOS off: every system produces exactly `new_tokens` tokens; nothing from a hub):

  gpt2-small-decode   GPT-2 small with random weights (`GPT2LMHeadModel(GPT2Config())`, seed 0, as
                      studies/decode_bench.py `hf_gpt2`), a 32-token prompt of seeded random ids, 128 new tokens
  gpt-tiny-trained    xdeploy's trained `gpt` preset `tiny` (models/weights/gpt-tiny.safetensors, a byte-level LM
                      of this repository's Markdown) converted to a Hugging Face GPT2LMHeadModel directory
                      (`hf_state_dict`: the inverse of models/gpt.py `state_dict_from_hf`), prompted with 32 bytes
                      of README text: greedy-token agreement on a decoder whose logits have real margins
                      (`--quick`: this workload with 32 new tokens, and the tiny Transformer's 8 -> 16; the test)
  transformer-base-decode  xdeploy's encoder-decoder `transformer` preset `base` (Vaswani et al.'s base: 6 + 6
                      layers, d 512, 32k vocabulary) with its seeded random weights (what `xdeploy export
                      transformer --preset base` exports), a 32-id source of seeded random ids, 128 target tokens
                      from BOS; the peers load its exact conversion to a Hugging Face MarianMTModel directory
                      (studies/peers_seq2seq.py: the same model, its channels permuted into Marian's positional
                      layout). Rows: transformers (MarianMTModel.generate), xdeploy (the same four routes; the `ov`
                      rows keep the self-attention cache in the engine), optimum-intel (OVModelForSeq2SeqLM,
                      stateful decoder), CTranslate2 (a Translator filled from the checkpoint through its spec API);
                      onnxruntime-genai and openvino-genai have no encoder-decoder text pipeline, and their rows
                      carry the tool's own refusal

Every system loads the same local safetensors directory (with a byte-level GPT-2 tokenizer written beside it:
`write_tokenizer`, 256 byte tokens in byte order, no merges; the tiny model's own token = byte mapping):

  transformers   GPT2LMHeadModel.generate(do_sample=False), eager fp32: the reference and the `× HF` baseline
  xdeploy        deploy/generate.py Generator on the checkpoint's export (export/cache.py cached_artifact):
                 `ort` fp32 (a decoder's KV cache kept in onnxruntime: GroupQueryAttention, deploy/ort_cache.py),
                 `ov` f32 (the artifact's stateful OpenVINO IR: the KV cache kept in the engine,
                 Generator's kv_cache="auto": a decoder's in OpenVINO's PagedAttention form, an
                 encoder-decoder's in the stateful step), `ort` int8-dynamic (also with the prompt
                 prefilled by graph `model`: Generator's prefill_graph; its default route runs the weights
                 shifted to int8 on VNNI without AMX, and the row with signed_prefill=True also on AMX, for
                 the prompt in a second session), `ov` f32 on the int8-dynamic export's IR (its weights
                 compressed to int8 by nncf: OpenVINO's int8 route), `ov` bf16 where the CPU has bf16 (the
                 bf16 hint; the f32 step on weights stored as bf16; and, decoders only, those steps with the
                 prompt on a bf16-hint compile of the same weights),
                 `ov` f32 on the fp16 export (its IR's weights stored as fp16: the precision class "fp16");
                 `--static-int8` adds the static Q/DQ `int8` export (opt-in: slow to export at GPT-2 small)
  optimum-intel  OVModelForCausalLM(export=True, stateful: the KV cache stays inside the engine) f32, bf16 where
                 the CPU has it, int8 weight-only (OVWeightQuantizationConfig(bits=8)), f32 on its IR re-saved with
                 fp16 weights (openvino.save_model compress_to_fp16, OpenVINO's own default)
  ctranslate2    TransformersConverter on the directory; compute types float32 and int8; generate_tokens with
                 sampling_topk=1, end_token=[] (no end token: EOS does not stop it)
  onnxruntime-genai  its model builder first; GPT-2 is not among the builder's architectures (and the builder of
                 0.18.0 does not import beside transformers 4.57), so the row runs onnxruntime-genai's own token
                 loop on optimum-onnx's `text-generation-with-past` export with a genai_config.json written here
                 (model type "llama": genai's decoder-only class with separate past key/value inputs, which that
                 export has; its "gpt2" type expects the combined past_%d layout). genai refuses an EOS id outside
                 the vocabulary, so EOS is kept from stopping it by min_length = max_length (which also masks the
                 EOS logit: a divergence only where EOS would be the argmax)
  openvino-genai LLMPipeline (f32; bf16, its default, where the CPU has it) on optimum-intel's f32 IR (f32 on
                 its fp16-weight IR for the fp16 row, and on its int8 weight-only IR for the int8 row, run with
                 OpenVINO's defaults for such a model), its
                 tokenizer converted by openvino_tokenizers, fed token ids (TokenizedInputs),
                 GenerationConfig(max_new_tokens, ignore_eos=True, greedy), its prefix cache off (the rounds repeat
                 one prompt: every row computes it every time)

The fp16 rows (fp16 weights computed in f32; decoder workloads only) are checked to keep those weights in fp16 in
OpenVINO's FullyConnected kernels (its weight decompression for a language model), not widened to f32 at compile.

Every OpenVINO row (xdeploy's, optimum-intel's, openvino-genai's) stores its KV cache in its compute precision
(KV_CACHE_PRECISION f32, bf16 on the bf16 rows): OpenVINO 2026.4's CPU default is a u8 cache (measured), a quantized
cache that no other row has.

Thread budget, the same for every row (stated in the output; default 2): torch.set_num_threads, xdeploy's
threads, OpenVINO INFERENCE_NUM_THREADS (NUM_STREAMS 1), CTranslate2 intra_threads (inter_threads 1),
onnxruntime-genai's intra_op_num_threads.

Metrics, with the definitions of NVIDIA AIPerf and MLPerf Inference: time to first token (TTFT: call to the
first output token), time per output token (TPOT = (end-to-end − TTFT) / (output tokens − 1)), inter-token
latency (ITL: the gaps between consecutive output tokens, p50/p90/p99 over every timed generation) from each
system's streaming API (transformers' `streamer`, CTranslate2's `generate_tokens` iterator, openvino-genai's
streamer, onnxruntime-genai's token loop, xdeploy's `step_s`), output tokens/s (output tokens / the median
end-to-end round), decode tokens/s (1 / TPOT) and its share of the memory-read roofline (weight bytes per token
÷ the measured read bandwidth, studies/decode_bench.py `weight_bytes_per_token` / `read_bandwidth`, plus the
KV cache at the full context; peers are charged the bytes of xdeploy's decode graph of the same precision, an
assumption: their graphs hold the same weights at that precision; and again over the median read bandwidth of a
probe timed once a round beside the systems, `pct_in_rounds`: studies/decode_bench.py `read_probe`), greedy-token
agreement with the transformers
fp32 reference (tokens equal before the first divergence, and that count's fraction), and peak resident memory
(each system loaded and run once in a child process of its own, not in the timing process).

Timing is interleaved (bench/interleave.py `compare`, bench/groups.py `grouped_comparison`), one comparison per
precision with the reference in each: every system is loaded once and each round runs every system, in rotated
order, at least 7 rounds; a system's round is the median of a block of its generations lasting at least
`--min-block-s` (0.25 s: one generation of GPT-2 small, several of the tiny models); `× HF` is the median of the
paired round ratios with its 95% interval, `vs fastest peer` the same for an xdeploy row over the fastest peer row
of its precision (same rounds); a comparison whose rounds stay too dispersed is "unstable" (no figure). A system
that fails to export, load or run is a row with its own one-line error; the study goes on. Records (kind
"peers_generate", core/records.py) go to <out>/records.jsonl, the table (reports/render.py) to
<out>/report/summary.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir

Row = tuple[str, str, str, str]  # (system, config, runtime, precision)
REFERENCE: Row = ("transformers", "generate eager fp32", "torch", "fp32")
XDEPLOY: tuple[Row, ...] = (("xdeploy", "ort fp32", "onnxruntime", "fp32"), ("xdeploy", "ov f32", "openvino", "fp32"),
                            ("xdeploy", "ov bf16", "openvino", "bf16"),
                            ("xdeploy", "ov f32, bf16 weights", "openvino", "bf16"),
                            ("xdeploy", "ov bf16 weights, bf16 prompt", "openvino", "bf16"),
                            ("xdeploy", "ov f32, fp16 weights", "openvino", "fp16"),
                            ("xdeploy", "ort int8 dynamic", "onnxruntime", "int8"),
                            ("xdeploy", "ort int8 dynamic, model-graph prefill", "onnxruntime", "int8"),
                            ("xdeploy", "ort int8 dynamic, int8-weight prefill", "onnxruntime", "int8"),
                            ("xdeploy", "ort int8 dynamic, 8-bit weight blocks", "onnxruntime", "int8"),
                            ("xdeploy", "ov f32, int8 weights", "openvino", "int8"))
XDEPLOY_STATIC: tuple[Row, ...] = (("xdeploy", "ort int8 static", "onnxruntime", "int8"),)
OPTIMUM_INTEL: tuple[Row, ...] = (("optimum-intel", "ov stateful f32", "openvino", "fp32"),
                                  ("optimum-intel", "ov stateful bf16", "openvino", "bf16"),
                                  ("optimum-intel", "ov stateful f32, fp16 weights", "openvino", "fp16"),
                                  ("optimum-intel", "ov stateful int8 weight-only", "openvino", "int8"))
CTRANSLATE2: tuple[Row, ...] = (("ctranslate2", "float32", "ctranslate2", "fp32"),
                                ("ctranslate2", "int8", "ctranslate2", "int8"))
ORT_GENAI: tuple[Row, ...] = (("onnxruntime-genai", "fp32 (optimum-onnx export)", "onnxruntime", "fp32"),)
OV_GENAI: tuple[Row, ...] = (("openvino-genai", "LLMPipeline f32", "openvino", "fp32"),
                             ("openvino-genai", "LLMPipeline bf16", "openvino", "bf16"),
                             ("openvino-genai", "LLMPipeline f32, fp16 weights", "openvino", "fp16"),
                             ("openvino-genai", "LLMPipeline f32, int8 weights", "openvino", "int8"))
READ_PROBE = "read probe"  # bench/interleave.py observer: not a system, never a row
SYSTEMS = ("transformers", "xdeploy", "optimum-intel", "ctranslate2", "onnxruntime-genai", "openvino-genai")
# xdeploy config -> (artifact precision, runner, runner options)
# the ov rows keep the KV cache in the engine (the artifact's stateful IR; refused in one line if it has none), as
# the Generator does by default: paged for a decoder, the stateful step for an encoder-decoder
_OV_ENGINE = {"format": "ir", "kv_cache": "auto"}
BLOCKS = "int8-dynamic/blocks"  # the int8-dynamic artifact with --int8-dynamic-weights blocks (a route's key)
XDEPLOY_ROUTE = {"ort fp32": ("fp32", "ort", {}), "ov f32": ("fp32", "ov:f32", _OV_ENGINE),
                 "ov bf16": ("fp32", "ov:bf16", _OV_ENGINE),
                 # the fp32 artifact's IR with its weights stored as bf16 behind decompression Converts, computed in
                 # f32 (ov option weights="bf16"): the bf16 rows' weight bytes, f32 arithmetic
                 "ov f32, bf16 weights": ("fp32", "ov:f32", _OV_ENGINE | {"weights": "bf16"}),
                 # the same one-token steps; the prompt on a second compile of those weights with the bf16 hint
                 # (bf16 arithmetic where it pays: many rows), the cache converted once (ov option prompt="bf16";
                 # a paged step's: decoders only)
                 "ov bf16 weights, bf16 prompt": ("fp32", "ov:f32", _OV_ENGINE | {"weights": "bf16", "prompt": "bf16"}),
                 # the fp16 artifact's IR (weights stored as fp16) computed in f32: OpenVINO keeps a language model's
                 # fp16 weights in its FullyConnected kernels, so a decode step reads half the bytes
                 "ov f32, fp16 weights": ("fp16", "ov:f32", _OV_ENGINE),
                 "ort int8 dynamic": ("int8-dynamic", "ort", {}),
                 # the prompt through graph `model` (7-bit int8 weights: VNNI/AMX kernels) instead of the decode
                 # graph (uint8 weights, U8U8): a faster first token there, a second copy of the weights
                 "ort int8 dynamic, model-graph prefill": ("int8-dynamic", "ort", {"prefill_graph": "model"}),
                 # the decode graph's uint8 weights shifted to int8 (the same integer products, u8*s8 kernels:
                 # VNNI/AMX CPUs only): on VNNI without AMX the default row's route too; on AMX the prompt only,
                 # through a second session (a second copy of the weights)
                 "ort int8 dynamic, int8-weight prefill": ("int8-dynamic", "ort", {"signed_prefill": True}),
                 # the decode graph's weights as onnxruntime's MatMulNBits (8-bit blocks of 256, int8 activations per
                 # block: --int8-dynamic-weights blocks), converted from the fp32 artifact
                 "ort int8 dynamic, 8-bit weight blocks": (BLOCKS, "ort", {}),
                 # the int8-dynamic artifact's IR, its weights compressed to int8 by nncf (OpenVINO's int8 route, the
                 # one openvino-genai and optimum-intel's int8 weight-only rows run), computed in f32
                 "ov f32, int8 weights": ("int8-dynamic", "ov:f32", _OV_ENGINE),
                 "ort int8 static": ("int8", "ort", {})}
# the README sentence whose first bytes prompt the trained tiny model (fixed here: an edit of the README must not
# change the workload)
PROMPT_TEXT = "Export, optimize, run and benchmark transformer models. Reference PyTorch models"


def all_rows(static_int8: bool = False) -> tuple[Row, ...]:
    """Every row of the study, the reference first (before `rows_here` drops bf16 where the CPU lacks it)."""
    return ((REFERENCE,) + XDEPLOY + (XDEPLOY_STATIC if static_int8 else ()) + OPTIMUM_INTEL + CTRANSLATE2
            + ORT_GENAI + OV_GENAI)


def row_name(row: Row) -> str:
    return f"{row[0]} {row[1]}"


@dataclass(frozen=True)
class Workload:
    name: str
    weights: str  # "random" (GPT-2 small, seed 0; the preset's seeded weights) | "trained" (xdeploy's gpt tiny)
    prompt_len: int
    new_tokens: int
    model: str = "gpt"  # the xdeploy model family (models/registry.py)
    # an encoder-decoder workload: xdeploy exports this preset (seeded weights) and the peers load its Marian
    # conversion (studies/peers_seq2seq.py); None: every system loads the workload's Hugging Face checkpoint
    preset: str | None = None

    @property
    def seq2seq(self) -> bool:
        from xdeploy.models.registry import get_family

        return get_family(self.model).capabilities.role == "encoder-decoder"


FULL = (Workload("gpt2-small-decode", "random", 32, 128), Workload("gpt-tiny-trained", "trained", 32, 128),
        Workload("transformer-base-decode", "random", 32, 128, model="transformer", preset="base"))
QUICK = (Workload("gpt-tiny-trained", "trained", 32, 32),
         Workload("transformer-tiny-decode", "random", 8, 16, model="transformer", preset="tiny"))


# ------------------------------------------------------------------------------------------ checkpoints ----

def hf_state_dict(tensors: dict[str, Any]) -> dict[str, Any]:
    """xdeploy `gpt` tensors -> GPT2LMHeadModel's: the inverse of models/gpt.py `state_dict_from_hf` (nn.Linear
    weights (out, in) back to Conv1D's (in, out), layer names back to `transformer.h.N...`; the LM head is tied
    to wte, so it has no tensor of its own)."""
    names = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj",
             "ffn.fc1": "mlp.c_fc", "ffn.fc2": "mlp.c_proj"}
    out = {}
    for key, w in tensors.items():
        if not key.startswith("layers."):
            out[f"transformer.{key}"] = w  # wte, wpe, ln_f
            continue
        _, i, rest = key.split(".", 2)
        mod, kind = rest.rsplit(".", 1)
        if mod not in names:
            raise XDeployError(f"gpt tensor {key!r} has no GPT-2 counterpart; expected one of {sorted(names)}")
        linear = kind == "weight" and not mod.startswith("ln")
        out[f"transformer.h.{i}.{names[mod]}.{kind}"] = w.T.contiguous() if linear else w
    return out


def write_tokenizer(d: Path, vocab_size: int, eos: int) -> None:
    """A byte-level GPT-2 tokenizer (GPT2TokenizerFast files) for a checkpoint directory: ids 0-255 are the 256
    bytes in byte order (the trained tiny model's token = byte), the ids above are placeholder tokens and `eos`
    is <|endoftext|>. No merges: GPT-2's own vocabulary is on the hub, out of reach; CTranslate2's converter and
    openvino_tokenizers need a tokenizer, and every system is fed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2TokenizerFast

    b2u = _bytes_to_unicode()
    vocab = {f"<|t{i}|>": i for i in range(256, vocab_size)} | {b2u[b]: b for b in range(256)}
    vocab = {k: v for k, v in vocab.items() if v != eos} | {"<|endoftext|>": eos}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    GPT2TokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                      unk_token="<|endoftext|>").save_pretrained(str(d))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (its byte-level BPE's alphabet; transformers 5 no longer exports
    it): printable Latin-1 bytes map to themselves, the others to 256 + n in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def make_checkpoint(w: Workload, root: Path) -> Path:
    """The workload's Hugging Face directory (config.json, model.safetensors, tokenizer files), written once."""
    import torch
    import transformers

    if w.seq2seq:
        from xdeploy.studies.peers_seq2seq import make_checkpoint as marian_checkpoint

        return marian_checkpoint(w.model, str(w.preset), root)

    if w.weights == "random":
        cfg, key = transformers.GPT2Config(), "gpt2-small-seed0"
        state = None
    else:
        from safetensors.torch import load_file

        from xdeploy.models.gpt import PRESETS
        from xdeploy.models.registry import WEIGHTS_DIR

        t = PRESETS["tiny"]
        src = WEIGHTS_DIR / str(t.weights)
        key = f"gpt-tiny-trained-{hashlib.sha256(src.read_bytes()).hexdigest()[:10]}"
        cfg = transformers.GPT2Config(vocab_size=t.vocab_size, n_positions=t.max_positions, n_embd=t.d_model,
                                      n_layer=t.n_layers, n_head=t.n_heads, layer_norm_epsilon=t.eps,
                                      bos_token_id=t.eos_token_id, eos_token_id=t.eos_token_id)
        state = hf_state_dict(load_file(str(src)))
    d = root / key
    if (d / "tokenizer.json").exists():
        return d
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to wte
            raise XDeployError(f"trained tiny -> GPT-2: missing {missing}, unexpected {unexpected}")
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    write_tokenizer(tmp, cfg.vocab_size, cfg.eos_token_id)
    with contextlib.suppress(OSError):
        tmp.rename(d)  # atomic: a crash leaves no half-written checkpoint under the final name
    return d


def prompt_ids(w: Workload, vocab_size: int) -> list[int]:
    if w.weights == "trained":
        return list(PROMPT_TEXT.encode()[:w.prompt_len])
    if w.seq2seq:  # a source of ordinary ids: CTranslate2 reads pad/start/end ids as its special tokens
        from xdeploy.studies.peers_seq2seq import SPECIAL_IDS

        return np.random.default_rng(0).integers(SPECIAL_IDS, vocab_size - 1, size=w.prompt_len).tolist()
    return np.random.default_rng(0).integers(0, vocab_size - 1, size=w.prompt_len).tolist()  # as decode_bench


# ------------------------------------------------------------------------------------------ systems ----

@dataclass
class Trace:
    """One generation: its tokens, each token's arrival (s after the call began) and the call's wall time."""

    tokens: list[int]
    times: list[float]
    total_s: float


@dataclass
class Context:
    w: Workload
    ckpt: Path
    work: Path
    prompt: list[int]
    threads: int
    vocab_size: int
    eos: int
    context_length: int
    log: Callable[[str], None] = field(default=lambda _m: None)
    # xdeploy's artifacts by precision, resolved once per run: the cache key hashes the exporter's code, so a
    # later lookup while the code changes (a shared checkout) would export again mid-run
    arts: dict[str, Path] = field(default_factory=dict)


class _Clock:
    """Token arrival times for the streaming APIs: `mark(n)` when n tokens have arrived."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []

    def mark(self, n: int = 1) -> None:
        t = time.perf_counter() - self.t0
        self.times.extend([t] * n)


def _xdeploy_artifact(ctx: Context, precision: str) -> Path:
    from xdeploy.export.cache import cached_artifact
    from xdeploy.export.openvino_ir import IR_PRECISIONS
    from xdeploy.verify.sensitivity import refine

    if precision == BLOCKS and precision not in ctx.arts:
        from xdeploy.api import convert_artifact
        from xdeploy.export.artifact import load_artifact
        from xdeploy.export.precision import PrecisionOptions

        src = _xdeploy_artifact(ctx, "fp32")
        out = ctx.work / "xdeploy" / f"{src.name}-int8-blocks"
        # the fp32 artifact's name keys the export code and library versions, so a conversion already there
        # (written whole: convert renames it into place) is this code's; a folder that does not load is redone
        with contextlib.suppress(XDeployError):
            ctx.arts[precision] = load_artifact(out).path
        if precision not in ctx.arts:
            ctx.arts[precision] = convert_artifact(src, out, "int8-dynamic", measured=False, force=True,
                                                   options=PrecisionOptions(int8_dynamic_weights="blocks"))
    if precision not in ctx.arts:
        source = {"preset": ctx.w.preset} if ctx.w.preset else {"checkpoint": ctx.ckpt}
        ctx.arts[precision] = cached_artifact(ctx.w.model, **source, precision=precision,
                                              root=ctx.work / "xdeploy", openvino_ir=precision in IR_PRECISIONS,
                                              log=ctx.log, refine=refine if precision == "int8" else None)
    return ctx.arts[precision]


def _open_transformers(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    import torch
    import transformers

    if ctx.w.seq2seq:
        from xdeploy.studies import peers_seq2seq

        return peers_seq2seq.open_transformers(ctx, _hf_generate)
    torch.set_num_threads(ctx.threads)
    model = transformers.GPT2LMHeadModel.from_pretrained(str(ctx.ckpt)).eval()
    return _hf_generate(model, ctx, torch)


def _hf_generate(model: Any, ctx: Context, torch: Any) -> Callable[[], Trace]:
    """transformers' generate with a streamer (its put() gets the prompt once, then every new token)."""
    ids = torch.tensor([ctx.prompt])
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "max_new_tokens": ctx.w.new_tokens,
          "min_new_tokens": ctx.w.new_tokens, "eos_token_id": None, "pad_token_id": ctx.eos}

    class Streamer:
        def __init__(self) -> None:
            self.clock, self.tokens, self.prompt_seen = _Clock(), [], False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            v = value.reshape(-1).tolist()
            self.tokens += v
            self.clock.mark(len(v))

        def end(self) -> None:
            pass

    def call() -> Trace:
        s = Streamer()
        with torch.inference_mode():
            model.generate(ids, streamer=s, **kw)
        return Trace(s.tokens, s.clock.times, time.perf_counter() - s.clock.t0)

    return call


def _open_xdeploy(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    from xdeploy.deploy.generate import GenerationConfig, Generator
    from xdeploy.deploy.registry import runner_class

    precision, runner, options = XDEPLOY_ROUTE[row[1]]
    art = _xdeploy_artifact(ctx, precision)
    # opened as it is timed beside the others (deploy/base.py Runner.interleaved_options)
    g = stack.enter_context(Generator(art, runner, threads=ctx.threads, **options,
                                      **runner_class(runner).interleaved_options))
    if options.get("signed_prefill") and not getattr(g.decode, "signed", False):
        raise XDeployError(f"xdeploy row {row[1]!r}: no int8-weight prefill here; it needs an int8-dynamic decoder "
                           "on a CPU whose u8*s8 dot product accumulates in int32 (VNNI or AMX)")
    if options.get("kv_cache") == "auto" and not g.engine_cache:
        raise XDeployError(f"xdeploy row {row[1]!r}: {art} keeps no KV cache in OpenVINO; expected an fp32 export "
                           "with its stateful OpenVINO IR")
    if getattr(g.decode, "signed", False) and "signed_prefill" not in options:
        ctx.log(f"{ctx.w.name}: xdeploy {row[1]}: the default route runs the decode graph's weights shifted to int8 "
                "on this CPU (VNNI without AMX)")
    gc = GenerationConfig(max_new_tokens=ctx.w.new_tokens, eos_token_id=-1)

    def call() -> Trace:
        t0 = time.perf_counter()
        out = g.generate([ctx.prompt], gc)
        total = time.perf_counter() - t0
        times = np.cumsum([out.time_to_first_token_s, *out.step_s]).tolist()
        return Trace(list(out.tokens[0]), times, total)

    return call


def _kv_cache(precision: str) -> dict[str, str]:
    """An OpenVINO row's KV cache in its compute precision (bf16 on the bf16 row, else f32), as xdeploy's `ov`
    rows store theirs: OpenVINO 2026.4's CPU default is a u8 cache, which no other row quantizes."""
    return {"KV_CACHE_PRECISION": "bf16" if precision == "bf16" else "f32"}


def _optimum_intel_dir(ctx: Context, precision: str) -> Path:
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    if precision == "fp16":
        return _fp16_weights_dir(_optimum_intel_dir(ctx, "fp32"))
    d = ctx.work / f"optimum-intel-{ctx.ckpt.name}-{'int8wo' if precision == 'int8' else 'f32'}"
    if not (d / "openvino_model.xml").exists():
        # stateful (the default for decoders): the KV cache lives in the infer request's state
        q = {"quantization_config": OVWeightQuantizationConfig(bits=8)} if precision == "int8" else \
            {"load_in_8bit": False}  # no weight compression: f32 weights, as in the ONNX exports
        OVModelForCausalLM.from_pretrained(str(ctx.ckpt), export=True, compile=False, stateful=True,
                                           **q).save_pretrained(str(d))
    return d


def _fp16_weights_dir(f32: Path) -> Path:
    """optimum-intel's f32 IR with its weights stored as fp16, as OpenVINO's own `ovc` and `save_model` store them by
    default (compress_to_fp16): the fp16-weight peers' model, beside the f32 one (its other files copied)."""
    import openvino as ov

    d = f32.with_name(f32.name.removesuffix("-f32") + "-f16w")
    if not (d / "openvino_model.xml").exists():
        with atomic_dir(d, force=True) as tmp:
            for f in f32.iterdir():
                if f.is_file() and not f.name.startswith("openvino_model."):
                    shutil.copy2(f, tmp / f.name)
            ov.save_model(ov.Core().read_model(str(f32 / "openvino_model.xml")), str(tmp / "openvino_model.xml"),
                          compress_to_fp16=True)
    return d


def _open_optimum_intel(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    import torch
    from optimum.intel import OVModelForCausalLM

    from xdeploy.studies.peers import _check_ov, _ov_options

    if ctx.w.seq2seq:
        from xdeploy.studies import peers_seq2seq

        return peers_seq2seq.open_optimum_intel(ctx, row, _hf_generate,
                                                _ov_options(row[3], ctx.threads) | _kv_cache(row[3]))
    torch.set_num_threads(ctx.threads)
    d = _optimum_intel_dir(ctx, row[3])
    m = OVModelForCausalLM.from_pretrained(str(d), ov_config=_ov_options(row[3], ctx.threads) | _kv_cache(row[3]),
                                           compile=True)
    if not m.stateful:
        raise XDeployError(f"optimum-intel's {d.name} is not stateful; expected the KV cache inside the engine")
    compiled = m.request.get_compiled_model()
    _check_ov(compiled, row[3], ctx.threads, f"optimum-intel compiled {d.name}")
    kv = compiled.get_property("KV_CACHE_PRECISION").to_string()
    if kv != _kv_cache(row[3])["KV_CACHE_PRECISION"]:
        raise XDeployError(f"optimum-intel compiled {d.name} with a {kv} KV cache; expected "
                           f"{_kv_cache(row[3])['KV_CACHE_PRECISION']}")
    return _hf_generate(m, ctx, torch)


def _ct2_dir(ctx: Context) -> Path:
    from ctranslate2.converters import TransformersConverter

    d = ctx.work / f"ctranslate2-{ctx.ckpt.name}"
    if not (d / "model.bin").exists():
        # float32 weights on disk; the int8 row quantizes them at load (compute_type="int8")
        TransformersConverter(str(ctx.ckpt)).convert(str(d), quantization="float32", force=True)
    return d


def _open_ctranslate2(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    if ctx.w.seq2seq:  # a Translator of the Marian checkpoint, fed the source; max_decoding_length: new tokens
        from xdeploy.studies.peers_seq2seq import ct2_dir, ct2_tokens

        tokens = ct2_tokens(ctx.vocab_size)
        return _ct2_stream(ctx, row, "Translator", ct2_dir(ctx), [tokens[i] for i in ctx.prompt],
                           max_decoding_length=ctx.w.new_tokens)
    d = _ct2_dir(ctx)
    vocab = json.loads((d / "vocabulary.json").read_text(encoding="utf-8"))
    start = [vocab[i] for i in ctx.prompt]  # CTranslate2 takes token strings; its vocabulary is the tokenizer's
    return _ct2_stream(ctx, row, "Generator", d, start, max_length=ctx.w.new_tokens)  # max_length: new tokens


def _ct2_stream(ctx: Context, row: Row, kind: str, d: Path, start: list[str], **length: int
                ) -> Callable[[], Trace]:
    """A CTranslate2 `kind` ("Generator" or "Translator") on `d` in the row's compute type, streaming greedy
    tokens from `start` (token strings) with no end token."""
    import ctranslate2

    compute = "int8" if row[3] == "int8" else "float32"
    m = getattr(ctranslate2, kind)(str(d), device="cpu", compute_type=compute, intra_threads=ctx.threads,
                                   inter_threads=1)
    if not m.compute_type.startswith(compute):  # int8 loads as int8_float32: float32 where it is not a GEMM
        raise XDeployError(f"ctranslate2 loaded {d.name} with compute type {m.compute_type}; expected {compute}")

    def call() -> Trace:
        c, toks = _Clock(), []
        # end_token=[]: no end token (the default is the model's EOS)
        for step in m.generate_tokens(start, sampling_topk=1, end_token=[], **length):
            toks.append(int(step.token_id))
            c.mark()
        return Trace(toks, c.times, time.perf_counter() - c.t0)

    return call


ORT_GENAI_BUILDER_CMD = "python -m onnxruntime_genai.models.builder -i <checkpoint> -o <dir> -p fp32 -e cpu"


def _ort_genai_dir(ctx: Context) -> tuple[Path, str]:
    """(a directory onnxruntime-genai runs, how it was made): its model builder's output when the builder takes
    the checkpoint, else optimum-onnx's `text-generation-with-past` export (the builder's refusal is the note)."""
    d = ctx.work / f"ort-genai-{ctx.ckpt.name}"
    note_file = d / "route.txt"
    if note_file.exists():
        return d, note_file.read_text(encoding="utf-8")
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ctx.ckpt), "-o",
                        str(tmp), "-p", "fp32", "-e", "cpu", "-c", str(tmp / "cache")],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode == 0 and (tmp / "genai_config.json").exists():
        note = "onnxruntime-genai model builder"
    else:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        note = f"builder refused: {lines[-1].strip() if lines else f'exit {r.returncode}'}; ran optimum-onnx export"
        from optimum.exporters.onnx import main_export

        main_export(str(ctx.ckpt), output=str(tmp), task="text-generation-with-past", device="cpu")
    (tmp / "route.txt").write_text(note, encoding="utf-8")
    tmp.rename(d)
    return d, note


def _genai_config(ctx: Context, d: Path) -> None:
    """genai_config.json for optimum-onnx's GPT-2 export (rewritten on every open: it carries the thread budget).
    Type "llama": onnxruntime-genai's decoder-only model with separate past key/value inputs (what the export
    has; its "gpt2" type expects the combined past_%d layout of ORT's old GPT-2 export); the math is the graph's."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(ctx.ckpt))
    hs = c.n_embd // c.n_head
    cfg = {"model": {"bos_token_id": ctx.eos, "eos_token_id": ctx.eos, "pad_token_id": ctx.eos,
                     "context_length": c.n_positions, "vocab_size": c.vocab_size, "type": "llama",
                     "decoder": {"session_options": {"log_id": "onnxruntime-genai", "intra_op_num_threads": ctx.threads,
                                                     "inter_op_num_threads": 1, "provider_options": []},
                                 "filename": "model.onnx", "head_size": hs, "hidden_size": c.n_embd,
                                 "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head,
                                 "num_hidden_layers": c.n_layer,
                                 "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                            "past_key_names": "past_key_values.%d.key",
                                            "past_value_names": "past_key_values.%d.value"},
                                 "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                             "present_value_names": "present.%d.value"}}},
           "search": {"do_sample": False, "max_length": c.n_positions, "min_length": 0, "num_beams": 1,
                      "num_return_sequences": 1, "past_present_share_buffer": False, "top_k": 1, "top_p": 1.0,
                      "temperature": 1.0, "repetition_penalty": 1.0, "early_stopping": True, "length_penalty": 1.0,
                      "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}}
    (d / "genai_config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")


def _open_ort_genai(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    import onnxruntime_genai as og

    if ctx.w.seq2seq:
        from xdeploy.studies import peers_seq2seq

        return peers_seq2seq.open_ort_genai(ctx)
    d, note = _ort_genai_dir(ctx)
    if note.startswith("builder refused"):
        _genai_config(ctx, d)
    ctx.log(f"onnxruntime-genai: {note}")
    model = og.Model(str(d))
    total = ctx.w.prompt_len + ctx.w.new_tokens
    ids = np.asarray([ctx.prompt], dtype=np.int32)

    def call() -> Trace:
        c = _Clock()
        p = og.GeneratorParams(model)
        # genai refuses an EOS id outside the vocabulary: min_length = max_length keeps EOS from stopping it
        p.set_search_options(max_length=total, min_length=total, do_sample=False, top_k=1)
        g = og.Generator(model, p)
        g.append_tokens(ids)
        toks = []
        while not g.is_done():
            g.generate_next_token()
            toks.append(int(g.get_next_tokens()[0]))
            c.mark()
        return Trace(toks, c.times, time.perf_counter() - c.t0)

    return call


def _open_ov_genai(ctx: Context, row: Row, stack: contextlib.ExitStack) -> Callable[[], Trace]:
    import openvino as ov
    import openvino_genai as og

    from xdeploy.studies.peers import _ov_options

    if ctx.w.seq2seq:
        from xdeploy.studies import peers_seq2seq

        return peers_seq2seq.open_ov_genai(ctx, _ov_options(row[3], ctx.threads) | _kv_cache(row[3]))
    d = _optimum_intel_dir(ctx, _ov_genai_ir(row))
    if not (d / "openvino_tokenizer.xml").exists():
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(ctx.ckpt)), with_detokenizer=True)
        ov.save_model(detok, str(d / "openvino_detokenizer.xml"))
        ov.save_model(tok, str(d / "openvino_tokenizer.xml"))
    # Its prefix cache off: every round repeats the same prompt, and openvino-genai (PagedAttention backend, the
    # default) would otherwise reuse the prompt's KV from the previous round instead of computing it (GPT-2 small
    # on Zen 3: first token 27-31 ms for a repeated prompt vs 62-78 ms for a new one), which no other row does.
    sched = og.SchedulerConfig()
    sched.enable_prefix_caching = False
    # the row's precision: bf16 is openvino-genai's own default where the CPU has it (rows_here drops the row
    # elsewhere), f32 is asked for
    hint = "bf16" if row[3] == "bf16" else "f32"
    pipe = og.LLMPipeline(str(d), "CPU", INFERENCE_PRECISION_HINT=hint, INFERENCE_NUM_THREADS=ctx.threads,
                          NUM_STREAMS=1, scheduler_config=sched, **_kv_cache(row[3]))
    gc = og.GenerationConfig()
    gc.max_new_tokens, gc.ignore_eos, gc.do_sample = ctx.w.new_tokens, True, False
    ids = np.asarray([ctx.prompt], dtype=np.int64)
    inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))

    class Streamer(og.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.clock, self.tokens = _Clock(), []

        def write(self, token: Any) -> Any:
            v = [int(token)] if isinstance(token, int) else [int(t) for t in token]
            self.tokens += v
            self.clock.mark(len(v))
            return og.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    def call() -> Trace:
        s = Streamer()
        s.clock = _Clock()
        pipe.generate(inputs, gc, s)
        return Trace(s.tokens, s.clock.times, time.perf_counter() - s.clock.t0)

    return call


OPENERS = {"transformers": _open_transformers, "xdeploy": _open_xdeploy, "optimum-intel": _open_optimum_intel,
           "ctranslate2": _open_ctranslate2, "onnxruntime-genai": _open_ort_genai, "openvino-genai": _open_ov_genai}


def prepare(ctx: Context, row: Row) -> None:
    """Write what the row loads (exports, conversions) into the work folder, once; nothing is timed."""
    system = row[0]
    if ctx.w.seq2seq and system != "xdeploy":
        from xdeploy.studies import peers_seq2seq

        if system == "optimum-intel":
            peers_seq2seq.optimum_intel_dir(ctx, row[3])
        elif system == "ctranslate2":
            peers_seq2seq.ct2_dir(ctx)
        elif system == "onnxruntime-genai":
            peers_seq2seq.ort_genai_refusal(ctx)
        elif system == "openvino-genai":
            peers_seq2seq.optimum_intel_dir(ctx, "fp32")
        return
    if system == "xdeploy":
        _xdeploy_artifact(ctx, XDEPLOY_ROUTE[row[1]][0])
    elif system == "optimum-intel":
        _optimum_intel_dir(ctx, row[3])
    elif system == "ctranslate2":
        _ct2_dir(ctx)
    elif system == "onnxruntime-genai":
        _ort_genai_dir(ctx)
    elif system == "openvino-genai":
        _optimum_intel_dir(ctx, _ov_genai_ir(row))


def _ov_genai_ir(row: Row) -> str:
    """The precision of optimum-intel's IR an openvino-genai row runs: its fp16-weight and int8 weight-only IRs for
    those rows; the f32 IR for f32 and bf16 (bf16 is a compile hint)."""
    return row[3] if row[3] in ("fp16", "int8") else "fp32"


def one_line(e: BaseException) -> str:
    """An exception as the one line a row shows: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else ""
    return text if isinstance(e, XDeployError) and text else f"{type(e).__name__}: {text}"[:300]


# ------------------------------------------------------------------------------------------ memory ----

def measure_memory(ctx: Context, row: Row, timeout: float = 600.0) -> tuple[float | None, str | None]:
    """(peak RSS in bytes of a child process that loads the row and generates once, or None; its error)."""
    spec = {"workload": ctx.w.name, "weights": ctx.w.weights, "prompt_len": ctx.w.prompt_len,
            "new_tokens": ctx.w.new_tokens, "model": ctx.w.model, "preset": ctx.w.preset, "ckpt": str(ctx.ckpt),
            "work": str(ctx.work), "threads": ctx.threads,
            "row": list(row), "arts": {k: str(v) for k, v in ctx.arts.items()}}
    try:
        r = subprocess.run([sys.executable, "-m", "xdeploy.studies.peers_generate", "--memory-probe", json.dumps(spec)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"memory probe timed out after {timeout:.0f} s"
    last = (r.stdout.strip().splitlines() or [""])[-1]
    try:
        out = json.loads(last)
        return float(out["peak_rss_bytes"]), None
    except (ValueError, KeyError, TypeError):
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return None, f"memory probe failed: {err[-1] if err else f'exit {r.returncode}'}"


def _memory_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """The child side of `measure_memory`: load one row, generate once, report the high-water RSS."""
    from xdeploy.bench.memory import peak_rss

    w = Workload(spec["workload"], spec["weights"], spec["prompt_len"], spec["new_tokens"], spec["model"],
                 spec["preset"])
    ctx = _context(w, Path(spec["ckpt"]), Path(spec["work"]), spec["threads"])
    ctx.arts = {k: Path(v) for k, v in spec.get("arts", {}).items()}  # the parent's exports, not a new lookup
    row = tuple(spec["row"])
    with contextlib.ExitStack() as stack:
        call = OPENERS[row[0]](ctx, row, stack)  # type: ignore[arg-type]
        tr = call()
    if len(tr.tokens) != w.new_tokens:
        raise XDeployError(f"{row_name(row)} generated {len(tr.tokens)} tokens; expected {w.new_tokens}")
    return {"peak_rss_bytes": peak_rss()}


def _context(w: Workload, ckpt: Path, work: Path, threads: int, log: Callable[[str], None] = lambda _m: None
             ) -> Context:
    cfg = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    positions = cfg.get("n_positions") or cfg["max_position_embeddings"]  # GPT-2's name, Marian's
    return Context(w, ckpt, work, prompt_ids(w, cfg["vocab_size"]), threads, cfg["vocab_size"], cfg["eos_token_id"],
                   positions, log)


# ------------------------------------------------------------------------------------------ metrics ----

def trace_metrics(traces: Sequence[Trace]) -> dict[str, Any]:
    """AIPerf / MLPerf Inference metrics over timed generations: TTFT, TPOT = (e2e − TTFT) / (n − 1) and e2e
    (medians over generations), ITL p50/p90/p99 over every gap between consecutive tokens of every generation."""
    if not traces:
        raise XDeployError("no timed generation to measure")
    n = len(traces[0].tokens)
    if n < 2 or any(len(t.tokens) != n or len(t.times) != n for t in traces):
        raise XDeployError(f"every generation must stream the same number (>= 2) of tokens; got "
                           f"{sorted({(len(t.tokens), len(t.times)) for t in traces})}")
    ttft = np.array([t.times[0] for t in traces])
    e2e = np.array([max(t.total_s, t.times[-1]) for t in traces])
    tpot = (e2e - ttft) / (n - 1)
    gaps = np.concatenate([np.diff(t.times) for t in traces])
    p50, p90, p99 = (float(x) for x in np.percentile(gaps, [50, 90, 99]))
    return {"ttft_s": float(np.median(ttft)), "tpot_s": float(np.median(tpot)), "e2e_s": float(np.median(e2e)),
            "itl_s": {"p50": p50, "p90": p90, "p99": p99}, "output_tokens": n}


def agreement(reference: Sequence[int], tokens: Sequence[int]) -> tuple[int, float]:
    """(tokens equal to the reference's before the first divergence, that count / the reference's length): the
    first divergence of deploy/generate.py `token_agreement`."""
    from xdeploy.deploy.generate import token_agreement

    first = token_agreement([reference], [tokens]).first_divergence[0]
    k = len(reference) if first is None else first
    return k, k / max(len(reference), 1)


def roofline_bytes(arts: dict[str, Path], kv_tokens: int) -> dict[str, float]:
    """Bytes one decode step reads per precision: the weights of xdeploy's decode graph (decode_bench's
    `weight_bytes_per_token`; bf16: the fp32 graph's at 2 bytes; fp16: the fp16 export's) plus the fp32 KV cache at
    `kv_tokens`."""
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.registry import dims
    from xdeploy.studies.decode_bench import weight_bytes_per_token

    def decode_graph(art: Any) -> Path:  # the graph the decoding loop steps (the model's declared feeds)
        return art.onnx_path(art.capabilities.decoding.decode_graph)

    out: dict[str, float] = {}
    if "fp32" in arts:
        fp32 = load_artifact(arts["fp32"], verify=False)
        kv = dims(fp32.config).kv_bytes(kv_tokens)
        wb = weight_bytes_per_token(decode_graph(fp32))
        out = {"fp32": wb + kv, "bf16": wb / 2 + kv}
        if "fp16" in arts:
            out["fp16"] = weight_bytes_per_token(decode_graph(load_artifact(arts["fp16"], verify=False))) + kv
        if "int8-dynamic" in arts:
            out["int8"] = weight_bytes_per_token(decode_graph(load_artifact(arts["int8-dynamic"], verify=False))) + kv
    return out


# ------------------------------------------------------------------------------------------ one workload ----

def _instances(name: str, replicas: int) -> list[str]:
    """The timed names of a row's instances: the row's own name, then "<row> #2", ..."""
    return [name] + [f"{name} #{k + 1}" for k in range(1, replicas)]


def _row_of(instance: str) -> str:
    return instance.split(" #", 1)[0]


def run_workload(w: Workload, *, work: Path, threads: int, rows: Sequence[Row], min_rounds: int, max_seconds: float,
                 attempts: int, min_block_s: float, bandwidth: tuple[float, str] | None, memory: bool,
                 max_group: int | None, log: Callable[[str], None], replicas: int = 2,
                 probe_mib: int = 1024) -> list[dict[str, Any]]:
    """Prepare, probe memory, then time every row of `rows` interleaved; one record per row (errors included).

    Each row but the reference is timed as `replicas` independently loaded instances in the same rounds (as the
    embedding study, studies/peers.py): a row's round is the mean over its instances, and the instances' A/A
    spread widens the band inside which an xdeploy row counts as tied with its fastest peer. Two instances of one
    OpenVINO model decoding GPT-2 small differed by 5-9% (compile order), so with one instance per system a 5%
    "behind" was not evidence (a direct A/B found a tie, docs/benchmarks.md).

    A read probe (studies/decode_bench.py `read_probe`, `probe_mib` MiB) is timed once a round beside the rows, not
    compared: each row's `roofline` also carries the read bandwidth of its own comparison's rounds (median) and its
    share of it (`pct_in_rounds`), beside the share of the best read peak (`pct`)."""
    from xdeploy.bench.groups import Group, grouped_comparison
    from xdeploy.bench.interleave import band_verdict, compare, instance_spread, pair_figure, paired_rows, row_rounds
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record

    if replicas < 1:
        raise XDeployError(f"replicas must be >= 1, got {replicas}")
    from xdeploy.studies.decode_bench import read_probe

    ckpt = make_checkpoint(w, work)
    ctx = _context(w, ckpt, work, threads, log)
    probe, probe_bytes, probe_how = read_probe(probe_mib, threads)
    base = row_name(REFERENCE)
    errors: dict[str, str] = {}
    # a decoder-only route (the prompt through graph `model`, or on its own compile of the paged step) has no
    # encoder-decoder counterpart, nor do the fp16-weight rows (the peers' encoder-decoder routes load f32 weights;
    # fp16 is measured on decoders)
    by_name = {row_name(r): r for r in rows
               if not (w.seq2seq and (r[3] == "fp16" or r[0] == "xdeploy"
                                      and {"prefill_graph", "signed_prefill", "prompt"}
                                      & set(XDEPLOY_ROUTE[r[1]][2])))}
    for name, row in by_name.items():  # exports and conversions first: none of it is timed or probed
        try:
            prepare(ctx, row)
        except Exception as e:  # noqa: BLE001 - a peer that cannot prepare is a row with its error
            errors[name] = one_line(e)
            log(f"{w.name}: {name}: {errors[name]}")
    arts = {}
    fp16 = ("fp16",) if any(r[3] == "fp16" for r in by_name.values()) else ()  # its bytes: the fp16 export's
    for p in ("fp32", "int8-dynamic", *fp16):
        with contextlib.suppress(Exception):
            arts[p] = _xdeploy_artifact(ctx, p)
    per_byte = roofline_bytes(arts, w.prompt_len + w.new_tokens)
    mem: dict[str, tuple[float | None, str | None]] = {}
    if memory:
        for name, row in by_name.items():
            if name not in errors:
                mem[name] = measure_memory(ctx, row)
                log(f"{w.name}: {name}: peak RSS "
                    f"{'?' if mem[name][0] is None else f'{mem[name][0] / 2**20:.0f} MiB'}")

    traces: dict[str, list[Trace]] = {}
    calls: dict[str, Callable[[], Trace]] = {}
    groups: dict[str, Any] = {}  # name -> (group number, its comparison)

    def open_one(stack: contextlib.ExitStack, name: str) -> Callable[[], None]:
        row = _row_of(name)  # an instance "<row> #k" opens the row once more
        if row in errors:
            raise XDeployError(errors[row])
        call = OPENERS[by_name[row][0]](ctx, by_name[row], stack)
        tr = call()  # warm-up: first-call allocations; also checks the row generates the workload's tokens
        if len(tr.tokens) != w.new_tokens:
            raise XDeployError(f"generated {len(tr.tokens)} tokens; expected {w.new_tokens}")
        calls[name] = call
        traces[name] = []
        return lambda: traces[name].append(call())

    def failed(name: str, e: Exception) -> None:
        if name == base:
            raise XDeployError(f"{w.name}: the reference ({base}) failed: {one_line(e)}")
        errors[name] = errors.get(name) or one_line(e)
        log(f"{w.name}: {name}: {errors[name]}")

    def measure(group_calls: dict[str, Callable[[], Any]], baseline: str | None) -> Any:
        for n in group_calls:
            traces[n].clear()
        log(f"{w.name}: timing {len(group_calls)} systems x {w.new_tokens} new tokens, interleaved rounds ...")
        # a round is the median of a block of generations lasting >= min_block_s (pyperf's loops): one generation
        # of GPT-2 small is seconds, one of the trained tiny GPT ~40 ms, where a single call per round left every
        # round-time IQR at 26-65% on this host (docs/benchmarks.md)
        return compare(group_calls, baseline=baseline, attempts=attempts, warmup=1, min_block_s=min_block_s,
                       min_rounds=min_rounds, max_rounds=max(min_rounds, 24), max_seconds=max_seconds, log=log,
                       observe={READ_PROBE: probe})

    precision_now = [""]

    def judge(group: Group) -> None:
        for n in group.comparison.series:
            if n in group.names and n not in groups:  # the reference's figures: from its first group
                groups[n] = (f"{precision_now[0]}-{group.number}", group.comparison, list(traces[n]))

    # one comparison per precision, the reference in each: the rows an xdeploy row is judged against are in its
    # rounds, and fewer systems are open at once (all ten of GPT-2 small held 8.2 GB in one process)
    for prec in dict.fromkeys(r[3] for r in rows):
        precision_now[0] = prec
        names = [base] + [i for n, r in by_name.items() if r[3] == prec and n != base for i in _instances(n, replicas)]
        if len(names) > 1 or base not in groups:
            grouped_comparison(names, open_one, measure, judge, failed, baseline=base, catch=Exception,
                               max_group=max_group, unit=_row_of)

    fp = fingerprint()
    versions = _versions()
    ref_tokens = groups[base][2][0].tokens
    # a row's timed instances (the reference: one), all in its group (grouped_comparison keeps them together)
    inst = {n: [i for i in _instances(n, 1 if n == base else replicas) if i in groups] for n in by_name}
    inst = {n: i for n, i in inst.items() if n in groups and i}
    # an attempt's first call is a warm-up; the instances' generations are pooled
    metrics = {n: trace_metrics([t for i in ii for t in (groups[i][2][1:] or groups[i][2])]) for n, ii in inst.items()}
    bandwidth = _peak_for(bandwidth, [per_byte[by_name[n][3]] / m["tpot_s"] for n, m in metrics.items()
                                      if by_name[n][3] in per_byte], log)
    bw = bandwidth[0] if bandwidth else None
    records = []
    rows_cmp = {n: groups[n][1] for n in inst}
    rounds_median = {n: float(np.median(list(row_rounds(rows_cmp[n].rounds, rows_cmp[n].round_ids, inst[n]).values())))
                     for n in inst}
    # instance 1 vs 2 of each row, paired by round: the A/A ratio whose spread widens the tie band
    aa = {n: paired_rows(rows_cmp[n].rounds, rows_cmp[n].round_ids, ii[:1], ii[1:2]) if len(ii) > 1 else None
          for n, ii in inst.items()}
    steady = {n: all(rows_cmp[n].stability(i)["stable"] for i in ii) for n, ii in inst.items()}
    for name, row in by_name.items():
        system, config, runtime, precision = row
        peak, mem_err = mem.get(name, (None, None))
        common = dict(workload=w.name, model=w.model, weights=w.weights, checkpoint=ckpt.name, batch=1,
                      prompt_len=w.prompt_len, new_tokens=w.new_tokens, system=system, config=config, runtime=runtime,
                      precision=precision, threads=threads, peak_rss_bytes=peak, versions=versions)
        if name not in inst:
            records.append(make_record("peers_generate", fp, **common, **_empty(), error=errors.get(name, "not run"),
                                       note=mem_err))
            continue
        number, cmp, trs = groups[name]
        m = metrics[name]
        tokens = trs[0].tokens
        if any(t.tokens != tokens for i in inst[name] for t in groups[i][2]):
            log(f"{w.name}: {name}: its generations differ from each other")
        agree_n, agree = agreement(ref_tokens, tokens)
        decode_tps = 1.0 / m["tpot_s"]
        roof = None
        if bw and precision in per_byte:
            roof_tps = bw / per_byte[precision]
            pct = 100.0 * decode_tps / roof_tps
            probe_s = cmp.observed.get(READ_PROBE) or []
            in_rounds = float(np.median([probe_bytes / t for t in probe_s])) if probe_s else None
            pct_rounds = None if in_rounds is None else 100.0 * decode_tps * per_byte[precision] / in_rounds
            roof = {"bytes_per_token": per_byte[precision], "bandwidth_bytes_per_s": bw,
                    "bandwidth_in_rounds_bytes_per_s": in_rounds,
                    "in_rounds_how": f"{probe_how}, timed once a round beside the systems (median over the "
                                     f"{len(probe_s)} rounds of this row's comparison)",
                    # above what the probe read in the same rounds: weights served from a cache (a model smaller
                    # than the last-level cache), not DRAM, so no DRAM share
                    "pct_in_rounds": pct_rounds if pct_rounds is not None and pct_rounds <= 100.0 else None,
                    "bandwidth_how": bandwidth[1] if bandwidth else "", "roofline_tokens_per_s": roof_tps,
                    "pct": pct if pct <= 100.0 else None,  # above the read peak: the peak was not one (_peak_for)
                    "assumption": "xdeploy's decode graph of this precision (weights not only gathered) + fp32 KV "
                                  "cache at the full context" + ("" if system == "xdeploy" else
                                                                 "; a peer is charged xdeploy's bytes")}
        t = cmp.thresholds
        # the row is steady only if every instance is; an unsteady instance lends the row its cause and reasons
        worst = next((cmp.stability(i) for i in inst[name] if not cmp.stability(i)["stable"]), cmp.stability(name))
        st = cmp.stability(name) | {"stable": steady[name], "cause": worst["cause"], "reasons": worst["reasons"],
                                    "replicas": {"count": len(inst[name]),
                                                 "round_median_s": [cmp.series[i].median_s for i in inst[name]],
                                                 "aa": None if aa[name] is None else
                                                 {"median": aa[name].median, "low": aa[name].low,
                                                  "high": aa[name].high}}}
        vs_hf = None
        if name != base:
            sp = paired_rows(cmp.rounds, cmp.round_ids, [base], inst[name])
            stable = bool(steady[name] and sp.rel_iqr <= t.series_rel_iqr)
            vs_hf = {"median": sp.median, "low": sp.low, "high": sp.high, "stable": stable,
                     "wide": sp.half_width > t.target, "cause": None if stable else (st.get("cause") or "noise")}
            st["speedup"] = {"median": sp.median, "low": sp.low, "high": sp.high}
        vs_peer = None
        peers = [n for n, r in by_name.items() if r[0] not in ("xdeploy", REFERENCE[0]) and r[3] == precision
                 and n in inst and groups[n][0] == number]
        if system == "xdeploy" and peers:
            peer = min(peers, key=lambda n: rounds_median[n])
            sp = paired_rows(cmp.rounds, cmp.round_ids, inst[peer], inst[name])
            band, verdict = band_verdict(sp, instance_spread(aa[name]), instance_spread(aa[peer]))
            # judged on the two rows' own ratios and the load (pair_reasons), not on either row's rounds; the tie
            # band 1 +- instance_spread: the two rows' larger A/A deviation (one instance: 0)
            vs_peer = {"peer": peer} | pair_figure(sp, cmp) | {"instance_spread": band - 1.0, "verdict": verdict}
        records.append(make_record(
            "peers_generate", fp, **common, ttft_s=m["ttft_s"], tpot_s=m["tpot_s"], e2e_s=rounds_median[name],
            itl_s=m["itl_s"], output_tokens_per_s=w.new_tokens / rounds_median[name],
            decode_tokens_per_s=decode_tps, agreement_tokens=agree_n, agreement=agree, roofline=roof,
            vs_hf=vs_hf, vs_peer=vs_peer, stability=st | {"group": number},  # "<precision>-<n>"
            error=None, note=mem_err))
    return records


def _peak_for(bandwidth: tuple[float, str] | None, streamed: list[float], log: Callable[[str], None],
              retries: int = 2) -> tuple[float, str] | None:
    """The read peak the roofline divides by, checked against what the timed systems streamed (bytes/s: decode
    tokens/s x bytes per token). A system reading faster than the "peak" means the peak was measured low (a
    noisy host, measured minutes earlier): it is measured again, up to `retries` times, keeping the best. A row
    still above it gets no % (pct None), never a figure over 100%."""
    fastest = max(streamed, default=0.0)
    if bandwidth is None or fastest <= bandwidth[0]:
        return bandwidth
    from xdeploy.studies.decode_bench import read_bandwidth

    for _ in range(retries):
        log(f"a system streamed {fastest / 1e9:.1f} GB/s, above the read peak {bandwidth[0] / 1e9:.1f} GB/s: "
            "measuring the peak again")
        again = read_bandwidth()
        if again[0] > bandwidth[0]:
            bandwidth = (again[0], again[1] + " (re-measured after the timing)")
        if fastest <= bandwidth[0]:
            break
    return bandwidth


def _empty() -> dict[str, Any]:
    return dict(ttft_s=None, tpot_s=None, e2e_s=None, itl_s=None, output_tokens_per_s=None,
                decode_tokens_per_s=None, agreement_tokens=None, agreement=None, roofline=None, vs_hf=None,
                vs_peer=None, stability=None)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("torch", "transformers", "onnxruntime", "openvino", "optimum", "optimum-onnx", "optimum-intel", "nncf",
              "ctranslate2", "onnxruntime-genai", "openvino-genai", "openvino-tokenizers"):
        with contextlib.suppress(PackageNotFoundError):
            out[d] = version(d)
    return out


# ------------------------------------------------------------------------------------------ CLI ----

def run(out: Path, *, quick: bool = False, workloads: Sequence[str] | None = None, threads: int = 2,
        systems: Sequence[str] = SYSTEMS, static_int8: bool = False, min_rounds: int = 7,
        max_seconds: float = 60.0, min_block_s: float = 0.25, attempts: int = 2, memory: bool = True,
        max_group: int | None = None,
        work: Path | None = None, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
        bandwidth: tuple[float, str] | None = None, replicas: int = 2, probe_mib: int | None = None) -> Path:
    """Run the study: <out>/records.jsonl and the rendered report <out>/report/ (summary.md). `bandwidth`:
    (bytes/s, how) for the roofline instead of measuring it here (a test's fixed figure); `replicas`: instances
    per system timed side by side (run_workload says why); `probe_mib`: the read probe's array (default 1024 MiB,
    64 with `quick`: the tests check the plumbing, not the figure)."""
    from xdeploy.bench.interleave import resolve_threads
    from xdeploy.bench.suite import apply_thread_env
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import write_records
    from xdeploy.studies.peers import no_bf16_note, rows_here

    apply_thread_env()  # passive OpenMP waiting before torch/ORT/OpenVINO/CTranslate2 start their pools
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or REFERENCE[0] not in systems:
        raise XDeployError(f"systems must include {REFERENCE[0]} (the reference) and come from {', '.join(SYSTEMS)}; "
                           f"got {', '.join(systems)}")
    if not min_block_s >= 0:
        raise XDeployError(f"min_block_s must be >= 0 seconds; got {min_block_s}")
    if min_rounds < 7:
        raise XDeployError(f"min_rounds must be >= 7 (the paired intervals need them); got {min_rounds}")
    chosen = QUICK if quick else FULL
    if workloads:
        unknown = [n for n in workloads if n not in {w.name for w in chosen}]
        if unknown:
            raise XDeployError(f"unknown workload(s) {unknown}; expected: {', '.join(w.name for w in chosen)}")
        chosen = tuple(w for w in chosen if w.name in workloads)
    threads = resolve_threads(threads)
    fp = fingerprint()
    rows = tuple(r for r in rows_here(all_rows(static_int8), fp) if r[0] in systems)
    work = work or Path("artifacts/peers")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    note = no_bf16_note(fp)
    if note:
        log(note)
    t0 = time.perf_counter()
    from xdeploy.studies.decode_bench import read_bandwidth

    bandwidth = bandwidth or read_bandwidth()
    log(f"read bandwidth {bandwidth[0] / 1e9:.1f} GB/s ({bandwidth[1]}); {threads} threads per system")
    records: list[dict[str, Any]] = []
    for w in chosen:
        records += run_workload(w, work=work, threads=threads, rows=rows, min_rounds=min_rounds,
                                min_block_s=min_block_s, max_seconds=max_seconds, attempts=attempts,
                                bandwidth=bandwidth, memory=memory, max_group=max_group, log=log,
                                replicas=replicas, probe_mib=probe_mib or (64 if quick else 1024))
        write_records(out / "records.jsonl", records)  # after each workload: a crash keeps what was measured
    from xdeploy.reports.render import render_report

    title = ("xdeploy generation vs its peers (transformers, optimum-intel, CTranslate2, onnxruntime-genai, "
             "openvino-genai)")
    meta = {"title": title, "command": " ".join(sys.argv), "note": note, "duration_s": time.perf_counter() - t0,
            "threads": threads}
    render_report(records, out / "report", meta=meta)
    write_records(out / "report" / "records.jsonl", records)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("reports/peers/generate"))
    ap.add_argument("--work", type=Path, default=Path("artifacts/peers"), help="checkpoints and exports (reused)")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny workloads: the trained GPT (32 new tokens), the Transformer (16) (the test)")
    ap.add_argument("--workloads", default="", help="comma-separated subset of the workload names")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--threads", type=int, default=2, help="threads per system (0: the cores free now)")
    ap.add_argument("--static-int8", action="store_true",
                    help="add xdeploy's static int8 export (slow to export at GPT-2 small)")
    ap.add_argument("--min-rounds", type=int, default=7)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="timed seconds per workload and attempt")
    ap.add_argument("--min-block-s", type=float, default=0.25,
                    help="a round times each system for at least this long (the median of its generations)")
    ap.add_argument("--attempts", type=int, default=2)
    ap.add_argument("--max-group", type=int, default=None, help="at most this many systems open beside the reference")
    ap.add_argument("--replicas", type=int, default=2,
                    help="instances of each system timed side by side (their A/A spread widens the tie band)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-system peak-RSS child processes")
    ap.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        if a.memory_probe:
            print(json.dumps(_memory_probe(json.loads(a.memory_probe))))
            return 0
        out = run(a.out, quick=a.quick, workloads=[x for x in a.workloads.split(",") if x] or None,
                  threads=a.threads, systems=[x for x in a.systems.split(",") if x], static_int8=a.static_int8,
                  min_rounds=a.min_rounds, max_seconds=a.max_seconds, min_block_s=a.min_block_s, attempts=a.attempts,
                  memory=not a.no_memory, max_group=a.max_group, work=a.work, replicas=a.replicas)
    except XDeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((out / "report" / "summary.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
