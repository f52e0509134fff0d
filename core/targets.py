"""The project's performance and accuracy targets (README "Limitations", docs/benchmarks.md): one table of data.

Library code and studies read their thresholds here and print `target.text()`; nothing else spells a target.
Whether a target is met is a measurement (a benchmark prints it), never a test assertion.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    what: str  # the quantity, in words
    minimum: float  # met when the measured value is >= minimum
    unit: str  # "x" (ratio), "%" (percent) or "" (a fraction or a plain number)
    source: str  # where it was set

    def met(self, value: float | None) -> bool:
        return value is not None and value >= self.minimum

    def text(self) -> str:
        """'>= 6x', '>= 70%', '>= 0.9999'."""
        return f">= {self.minimum:g}{self.unit}"


TARGETS: dict[str, Target] = {
    # xdeploy bench / xdeploy run: the fastest engine of a configuration
    "speedup_vs_eager": Target("best engine's speed-up over PyTorch eager fp32, parity passing", 6.0, "x",
                               "README"),
    "pct_of_gemm_peak": Target("best engine's achieved FLOP/s as % of the measured GEMM peak of its precision",
                               70.0, "%", "README"),
    # studies/runner_compare.py (BERT-base b1 s128)
    "ort_fp32_vs_eager": Target("ONNX Runtime fp32 speed-up over PyTorch eager fp32", 2.0, "x", "issue #4"),
    "ov_bf16_vs_eager": Target("OpenVINO bf16 speed-up over PyTorch eager fp32", 4.0, "x", "issue #4"),
    # studies/decode_bench.py (gpt small, batch 1, greedy)
    "decode_fp32_vs_hf": Target("fp32 decode tokens/s over Hugging Face generate", 1.5, "x", "issue #6"),
    "decode_best_vs_hf": Target("fastest precision's decode tokens/s over Hugging Face generate", 3.0, "x",
                                "issue #6"),
    "decode_best_agreement": Target("that precision's greedy token agreement with PyTorch fp32", 0.95, "",
                                    "issue #6"),
    # studies/embed_bench.py (all-MiniLM-L6-v2 vs sentence-transformers)
    "embed_fp32_vs_st": Target("fp32 sentences/s over sentence-transformers", 3.0, "x", "issue #9"),
    "embed_fp32_cosine": Target("fp32 minimum per-sentence cosine vs sentence-transformers", 0.9999, "",
                                "issue #9"),
    "embed_best_vs_st": Target("best precision's sentences/s over sentence-transformers", 5.0, "x", "issue #9"),
    "embed_best_cosine": Target("best precision's minimum per-sentence cosine", 0.99, "", "issue #9"),
    "embed_best_retrieval": Target("best precision's queries with the same nearest neighbour (fraction)", 0.99, "",
                                   "issue #9"),
}
