"""The PyTorch reference of one graph: the model method the graph was exported from, called on the graph's inputs,
its outputs named by the graph and widened to float32 numpy.

One definition for the torch runner (deploy/torch_runner.py, and so parity's reference) and the golden probes
the exporter writes into every artifact (export/probes.py): a probe's reference output is what parity calls the
reference. The caller sets the modes (torch.inference_mode, autocast) and puts the tensors on their device."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from .spec import Graph


def graph_outputs(fn: Callable[..., Any], graph: Graph, tensors: Sequence[torch.Tensor], *,
                  keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """`fn(*tensors)` (a model method, e.g. `module.decode`, or its torch.compile) -> {output name: float32
    array}; the method returns every graph output in graph order (a tensor or a tuple). `keep`: only these."""
    out = fn(*tensors)
    out = out if isinstance(out, tuple) else (out,)
    return {t.name: o.float().cpu().numpy() for t, o in zip(graph.outputs, out) if keep is None or t.name in keep}
