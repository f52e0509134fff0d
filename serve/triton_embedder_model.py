"""Triton Python-backend model of `xdeploy serve`: strings -> vectors through xdeploy's Embedder, one request failing
alone. Copied into the server's temporary model repository by serve/server.py (run_server); runs in the serving
environment's Python (xdeploy installed there, torch-free Embedder).

    TEXT BYTES [n, 1] (UTF-8)  ->  EMBEDDING FP32 [n, d]

Triton's dynamic batcher hands execute() several requests at once. Each is checked on its own (shape, UTF-8,
size); the valid ones are embedded together in one Embedder call (length-sorted batches inside) and split back;
an invalid one gets an error response naming its problem while the others get their vectors. (PyTriton's
`bind` API answers a whole dynamic batch with one error, which is why the server uses this model instead.)
Parameters (config.pbtxt): artifact, runner, threads, tokenizer, batch_size, max_text_bytes, verify (the
golden probes: checked by the server before Triton starts, so here the pass is remembered).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.embedder import Embedder


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.max_text_bytes = int(p["max_text_bytes"])
        self.embedder = Embedder(p["artifact"], runner=p["runner"], batch_size=int(p["batch_size"]),
                                 threads=int(p["threads"]), tokenizer=p["tokenizer"],
                                 verify=p.get("verify", "true") == "true")

    def _texts(self, request):
        """The request's sentences as str, or raise XDeployError saying what is wrong with this request."""
        text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()  # object [n, 1]
        if text.ndim != 2 or text.shape[1] != 1:
            raise XDeployError(f"TEXT must have shape [batch, 1], got {list(text.shape)}")
        out = []
        for i, x in enumerate(text[:, 0].tolist()):
            b = x if isinstance(x, bytes) else str(x).encode("utf-8")
            if len(b) > self.max_text_bytes:
                raise XDeployError(f"sentence {i} has {len(b)} bytes; the limit is {self.max_text_bytes}")
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise XDeployError(f"sentence {i} is not valid UTF-8 (byte {e.start})") from None
        return out

    def execute(self, requests):
        texts, errors = [], []
        for r in requests:
            try:
                texts.append(self._texts(r))
                errors.append(None)
            except XDeployError as e:
                texts.append([])
                errors.append(str(e))
        try:
            vecs = self.embedder.embed([t for ts in texts for t in ts])  # [sum n_i, d]
        except XDeployError as e:  # not caused by one request (every input was checked): fail them all
            return [pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
                    for _ in requests]
        responses, k = [], 0
        for ts, err in zip(texts, errors):
            if err is not None:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(err)))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("EMBEDDING", np.ascontiguousarray(vecs[k:k + len(ts)]))]))
            k += len(ts)
        return responses

    def finalize(self):
        self.embedder.close()
