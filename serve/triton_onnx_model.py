"""Triton Python-backend model running the ONNX graph with onnxruntime, copied into a repository by
`xdeploy triton --graph-backend python`.

For Triton builds without the onnxruntime backend (e.g. the tritonserver bundled with PyTriton, which has only
the Python backend). Same inputs/outputs as the onnxruntime_onnx config; needs numpy + onnxruntime in Triton's
Python environment. Requests batched together by Triton have different padded lengths, so each request is run
on its own: input_ids/attention_mask/token_type_ids INT64 [b, s] -> the graph's outputs.
"""

import json
import os

import onnxruntime as ort
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(params.get("intra_op_thread_count", "0"))
        so.inter_op_num_threads = 1
        # the onnxruntime optimizers xdeploy's CPU sessions leave out, ';'-separated (serve/triton.py writes them
        # from deploy/sessions.py ORT_CPU_SLOW_FUSIONS; xdeploy is not importable in Triton's interpreter)
        if params.get("ort_disabled_optimizers"):
            so.add_session_config_entry("optimization.disable_specified_optimizers", params["ort_disabled_optimizers"])
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in cfg["input"]]
        self.outputs = [o["name"] for o in cfg["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs}
            try:
                outs = self.session.run(self.outputs, feeds)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, o) for n, o in zip(self.outputs, outs)]))
            except Exception as e:  # onnxruntime's own exception types (bad shapes, ids out of range, ...)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
