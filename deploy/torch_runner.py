"""The eager PyTorch reference: fp32, bf16 autocast on the CPU (variant "bf16"), fp16 weights and activations on
CUDA (variant "fp16"; a clear error without a GPU), optional torch.compile (variant "compile")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from xdeploy.core.errors import XDeployError

from .base import Runner, RunnerInfo, cuda_gaps, validate_feeds

if TYPE_CHECKING:
    import torch

# torch and the model registry are imported where a runner is opened, not here: the runner registry reads this
# class's attributes (deploy/registry.py `specs`) in commands that never open it (`xdeploy convert`).


def load_reference(artifact: Any) -> torch.nn.Module:
    """Rebuild the PyTorch model an artifact was exported from (its reference/model.safetensors)."""
    from safetensors.torch import load_file

    from xdeploy.models.registry import build_loaded, get_family

    path = artifact.path / "reference" / "model.safetensors"
    if not path.exists():
        raise XDeployError(f"artifact {artifact.path} has no reference/model.safetensors for the torch runner")
    return build_loaded(get_family(artifact.model), artifact.config, load_file(str(path)), source=str(path))


class TorchRunner(Runner):
    name = "torch"
    variants = ("", "fp32", "bf16", "fp16", "compile")
    variant_precisions = {"bf16": "bf16", "fp16": "fp16"}
    gpu_variants = ("fp16",)
    runs_graph = False  # the PyTorch module rebuilt from the artifact's reference weights

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        return cuda_gaps() if variant in cls.gpu_variants else []

    def _load(self) -> None:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        self.device = torch.device("cpu")
        if self.variant == "fp16":
            missing = self.gaps(self.variant)
            if missing:
                raise XDeployError(f"runner 'torch:fp16' runs on CUDA only; {missing[0]}; use 'torch:bf16' on the "
                                   "CPU")
            self.device = torch.device("cuda", 0)
        from xdeploy.models.registry import get_family

        self.module = load_reference(self.artifact)
        # the method is the manifest's word (untrusted): it must be the one the family exports this graph from
        spec = get_family(self.artifact.model).spec(self.artifact.config)
        want = next((g.method for g in spec.graphs if g.name == self.graph.name), None)
        if self.graph.method != want:
            raise XDeployError(f"artifact {self.artifact.path}: graph {self.graph.name!r} names method "
                               f"{self.graph.method!r}; the {self.artifact.model} family computes "
                               + (f"it with {want!r}" if want else "no such graph"))
        if self.variant == "fp16":
            self.module = self.module.half().to(self.device)
        fn = getattr(self.module, self.graph.method)
        self.fn = torch.compile(fn) if self.variant == "compile" else fn

    def _autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.variant == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _call(self, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
        import torch

        from xdeploy.models.reference import graph_outputs

        with torch.inference_mode(), self._autocast():  # the reference itself: models/reference.py
            return graph_outputs(self.fn, self.graph, tensors, keep=set(self.output_names))

    def _tensors(self, feeds: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        import torch

        ts = [torch.from_numpy(feeds[t.name]).to(self.device) for t in self.graph.inputs]
        # fp16 on CUDA: float inputs (pixels, KV caches) follow the half weights; ids and masks stay int64.
        return [t.half() if self.variant == "fp16" and t.is_floating_point() else t for t in ts]

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call(self._tensors(feeds))

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        import torch

        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        tensors = self._tensors(checked)

        def call() -> Any:
            with torch.inference_mode(), self._autocast():
                out = self.fn(*tensors)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the work, not the kernel launches
            return out

        return call

    def info(self) -> RunnerInfo:
        import torch

        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""), device=str(self.device),
                          precision=self.variant if self.variant in ("bf16", "fp16") else "fp32",
                          threads=torch.get_num_threads(), versions={"torch": torch.__version__})
