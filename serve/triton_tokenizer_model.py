"""Triton Python-backend model: strings -> token ids, copied into a repository by `xdeploy triton`.

Runs inside Triton's Python backend (needs numpy + tokenizers there, not xdeploy). It tokenizes like
xdeploy.deploy.embedder.Embedder: special tokens added, truncated to `max_length` tokens from the right (the
tokenizer re-adds [SEP]), each request padded to a multiple of `pad_to` (parameters in config.pbtxt).

    TEXT BYTES [b, 1] (UTF-8)  ->  input_ids / attention_mask / token_type_ids INT64 [b, s]
A request with text that is not UTF-8 gets an error response; the other requests of the batch are served.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.max_length = int(params["max_length"])
        self.pad_to = max(1, int(params.get("pad_to", "1")))
        self.outputs = params.get("inputs", "input_ids,attention_mask,token_type_ids").split(",")
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, strategy="longest_first", direction="right")

    def _encode(self, texts):
        strs = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]
        encs = self.tokenizer.encode_batch(strs)
        longest = max(len(e.ids) for e in encs)
        s = min(-(-longest // self.pad_to) * self.pad_to, max(self.max_length, longest))
        ids = np.zeros((len(encs), s), np.int64)  # [b, s]; pad id 0 is masked out anyway
        mask = np.zeros((len(encs), s), np.int64)
        types = np.zeros((len(encs), s), np.int64)
        for row, e in enumerate(encs):
            k = len(e.ids)
            ids[row, :k], mask[row, :k], types[row, :k] = e.ids, 1, e.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()  # object [b, 1]
                if text.ndim != 2 or text.shape[1] != 1 or text.shape[0] == 0:
                    raise ValueError(f"TEXT must have shape [batch, 1], got {list(text.shape)}")
                feeds = self._encode(text[:, 0].tolist())
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, feeds[n]) for n in self.outputs]))
            except (UnicodeDecodeError, ValueError) as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
