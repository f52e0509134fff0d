"""Triton Python-backend model: token states -> one vector per input, copied into a repository by `xdeploy triton`.

Runs inside Triton's Python backend (numpy only). Pools like xdeploy.deploy.embedder.pool (the manifest's
`pooling` record is written into config.pbtxt parameters `mode` and `normalize`):

    last_hidden_state FP32|FP16 [b, s, d], attention_mask INT64 [b, s]  ->  EMBEDDING FP32 [b, d]
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend


def pool(hidden, mask, mode, normalize):
    h = hidden.astype(np.float32, copy=False)
    m = mask.astype(np.float32)[:, :, None]  # [b, s, 1]
    if mode == "mean":
        out = (h * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    elif mode == "cls":
        out = h[:, 0].copy()
    else:  # max over real tokens
        out = np.where(m > 0, h, np.float32(-1e9)).max(axis=1)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32, copy=False)


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.mode = params.get("mode", "cls")
        self.normalize = params.get("normalize", "false") == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            out = pool(hidden, mask, self.mode, self.normalize)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", out)]))
        return responses
