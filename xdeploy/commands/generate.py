"""xdeploy generate: KV-cache text generation (greedy, sampling, beam search) on any runner."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from xdeploy.commands import THREADS_HELP, add_json_option, write_json
from xdeploy.core.errors import XDeployError
from xdeploy.deploy.generate import KV_CACHES

if TYPE_CHECKING:
    from xdeploy.export.artifact import Artifact


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL|ARTIFACT",
                   help="a model name (gpt, transformer: exported first, or reused from artifacts/) or an artifact dir")
    p.add_argument("--runner", default="ort", help="runner spec: torch, ort, ov, ... (default ort)")
    p.add_argument("--preset", help="preset when MODEL is a name (default: the first preset)")
    p.add_argument("--precision", default="fp32", help="export precision when MODEL is a name (default fp32)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-len", type=int, metavar="N", help="random prompt of N tokens (seeded by --seed)")
    src.add_argument("--prompt", metavar="TEXT", help="text prompt (needs an artifact with a tokenizer)")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--batch", type=int, default=1, help="rows of random prompts with --prompt-len (default 1)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="M", help="tokens to generate (default 32)")
    p.add_argument("--beams", type=int, default=1, metavar="K", help="beam width (default 1: greedy/sampling)")
    p.add_argument("--length-penalty", type=float, default=0.75,
                   help="beam score = sum log p / generated_len ** this (default 0.75)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of random prompts")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens tokens")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow)")
    p.add_argument("--prefill-graph", metavar="GRAPH",
                   help="prefill with this graph (gpt: model) instead of the decode graph: a second copy of the "
                        "weights; faster first token for int8-dynamic on VNNI/AMX CPUs")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="auto",
                   help="where the KV cache lives: engine (inside OpenVINO: runner ov on an fp32 or fp16 artifact "
                        "with its IR; inside onnxruntime: runner ort on a decoder, its attention rewritten to "
                        "GroupQueryAttention), paged (the engine's cache in OpenVINO's PagedAttention form, decoders "
                        "on ov), loop (a buffer bound into the decode graph), auto (default: the engine where it "
                        "can, on ov paged for a decoder)")
    p.add_argument("--signed-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="ort, int8-dynamic: the decode graph's weights shifted to int8 (the same integer products, "
                        "onnxruntime's faster u8*s8 kernels). Default: for every call on a CPU with VNNI and without "
                        "AMX (one copy of the weights), nowhere else. --signed-prefill also on AMX, for prompts "
                        "only (a second session's memory); --no-signed-prefill: never")
    p.add_argument("--bf16-weights", action="store_true",
                   help="ov on an fp32 artifact: its weights stored as bf16, the arithmetic f32 (half the bytes a "
                        "decode step reads; judged at the bf16 tolerance)")
    p.add_argument("--bf16-prompt", action="store_true",
                   help="with --bf16-weights, a decoder on ov's paged cache: the prompt on a second, bf16-arithmetic "
                        "compile of those weights (the bf16 hint's first token), the steps as --bf16-weights")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--no-verify", action="store_true",
                   help="run the artifact without checking its golden probes on this machine (says so on stderr)")
    p.add_argument("--out", metavar="DIR", help="where to export when MODEL is a name "
                                                "(default artifacts/MODEL-PRESET-PRECISION, reused if present)")
    add_json_option(p)


def _artifact(args: argparse.Namespace) -> Artifact:
    from xdeploy.deploy.generate import decoding_feeds
    from xdeploy.export.artifact import load_artifact

    path = Path(args.model)
    if path.is_dir():
        art = load_artifact(path)
        decoding_feeds(art)  # one line for an artifact of a model that does not generate
        return art
    from xdeploy.models.registry import families, get_family

    family = get_family(args.model)  # one-line error for an unknown name that is not a directory either
    if not family.capabilities.generates:
        raise XDeployError(f"model {family.name!r} does not generate text: it is an {family.capabilities.role} "
                           f"model; generation supports: {', '.join(f.name for f in families(generates=True))}")
    preset = args.preset or next(iter(family.presets))
    out = Path(args.out or f"artifacts/{family.name}-{preset}-{args.precision}")
    if out.is_dir():
        art = load_artifact(out)
        source = art.manifest.get("source") or {}
        if (art.model, art.precision, source.get("preset")) != (family.name, args.precision, preset):
            raise XDeployError(f"{out} holds {art.model}/{source.get('preset')}/{art.precision}, not "
                               f"{family.name}/{preset}/{args.precision}; pass --out DIR or remove it")
        return art
    from xdeploy.export.onnx_export import export

    print(f"exporting {family.name} --preset {preset} --precision {args.precision} -> {out}")
    return load_artifact(export(family.name, preset=preset, precision=args.precision, out=out))


def _prompts(args: argparse.Namespace, art: Artifact) -> tuple[list[list[int]], object | None]:
    import numpy as np

    vocab = art.vocabulary
    tokenizer = None
    if art.tokenizer_dir is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(art.tokenizer_dir / "tokenizer.json"))
    if args.prompt is not None:
        if tokenizer is None:
            raise XDeployError(f"model {art.model} at {art.path} has no tokenizer (random-weight presets have "
                               "none); pass token ids with --prompt-ids 1,2,3 or a random prompt with --prompt-len N")
        return [tokenizer.encode(args.prompt, add_special_tokens=False).ids], tokenizer
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise XDeployError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not ids:
            raise XDeployError("--prompt-ids needs at least one token id")
        return [ids], tokenizer
    n = 8 if args.prompt_len is None else args.prompt_len
    if n < 1 or args.batch < 1:
        raise XDeployError(f"--prompt-len and --batch must be >= 1, got {n} and {args.batch}")
    rng = np.random.default_rng(args.seed)
    # random-weight models have no special vocabulary beyond EOS: draw from every id except EOS
    ids = rng.integers(0, vocab.size - 1, size=(args.batch, n))
    ids[ids >= vocab.eos_token_id] += 1
    return ids.tolist(), tokenizer


def run(args: argparse.Namespace) -> int:
    from xdeploy.deploy.generate import GenerationConfig, Generator
    from xdeploy.deploy.registry import check_spec

    # _artifact says in one line when the artifact cannot generate (a BERT or ViT artifact), before the prompts
    # are built from a config that has no vocabulary of tokens to generate
    art = _artifact(args)
    gc = GenerationConfig(max_new_tokens=args.new_tokens, num_beams=args.beams, do_sample=args.sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          length_penalty=args.length_penalty, eos_token_id=-1 if args.ignore_eos else None)
    # every usage error (settings, runner, prompt) before a runner opens and the golden probes run
    gc.check()
    check_spec(args.runner)
    rows, tokenizer = _prompts(args, art)
    with Generator(art, args.runner, use_cache=not args.no_cache, threads=args.threads,
                   verify=not args.no_verify, prefill_graph=args.prefill_graph, kv_cache=args.kv_cache,
                   **({} if args.signed_prefill is None else {"signed_prefill": args.signed_prefill}),
                   **({"weights": "bf16"} if args.bf16_weights else {}),
                   **({"prompt": "bf16"} if args.bf16_prompt else {})) as g:
        if args.signed_prefill and not getattr(g.decode, "signed", False):
            print("xdeploy: note: --signed-prefill is not used here: it needs runner ort keeping the cache of an "
                  "int8-dynamic decoder on a CPU with VNNI or AMX", file=sys.stderr)
        out = g.generate(rows, gc)
    mode = f"beam search k={gc.num_beams}" if gc.num_beams > 1 else ("sampling" if gc.do_sample else "greedy")
    print(f"{art.model} ({art.precision}) on {args.runner}, {mode}, {out.mode}: {out.new_tokens} new tokens "
          f"in {out.total_s:.3f} s ({out.tokens_per_s:.1f} tokens/s); time to first token "
          f"{out.time_to_first_token_s * 1e3:.1f} ms")
    if out.step_s:
        import numpy as np

        p50, p90 = np.percentile(out.step_s, [50, 90])
        print(f"per-token latency after the first: p50 {p50 * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms "
              f"over {len(out.step_s)} steps")
    for i, (prompt, toks, stop) in enumerate(zip(rows, out.tokens, out.stop)):
        score = f", score {out.scores[i]:.4f}" if out.scores is not None else ""
        print(f"[{i}] prompt {len(prompt)} tokens -> {len(toks)} new ({stop}{score}): {' '.join(map(str, toks))}")
        if tokenizer is not None:
            print(f"    text: {tokenizer.decode(list(toks))!r}")
    write_json(args.json, {"artifact": str(art.path), "model": art.model, "precision": art.precision,
                           "runner": args.runner, "config": dataclasses.asdict(gc), "prompts": rows}
               | out.as_dict())
    return 0
