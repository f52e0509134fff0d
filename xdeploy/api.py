"""The public Python API in one import: `from xdeploy import api`.

Everything a user script needs, re-exported from the layer that owns it (the CLI is thin over these):

    art = api.export("bert", preset="minilm", precision="fp32", out="artifacts/bert")   # -> artifact path
    with api.open_runner("ort", art) as r: ...                                          # any runner spec
    report = api.check_artifact(art, ["ort", "ov"])                                     # parity vs PyTorch
    api.run_job(api.RunConfig(out="reports/latest"))                                    # the main job
"""

from __future__ import annotations

from xdeploy.deploy.embedder import Embedder
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.registry import open_runner
from xdeploy.deploy.tokenizer_graph import tokenizer_graph_builder
from xdeploy.export.artifact import Artifact, load_artifact
from xdeploy.export.convert import convert_artifact
from xdeploy.export.onnx_export import export
from xdeploy.models.spec import make_feeds
from xdeploy.pipeline import RunConfig, RunResult, run_job
from xdeploy.verify.parity import ParityReport, check_artifact

__all__ = [
    "Artifact", "Embedder", "GenerationConfig", "Generator", "ParityReport", "RunConfig", "RunResult",
    "check_artifact", "convert_artifact", "export", "load_artifact", "make_feeds", "open_runner", "run_job",
    "tokenizer_graph_builder",
]
