"""`xdeploy triton`: model repositories checked by parsing config.pbtxt into Triton's ModelConfig protobuf and
comparing with the manifest; the repository's Python-backend tokenizer/pooling code chained with the ONNX graph
gives the in-process Embedder's vectors."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from tiny_text import tiny_text_artifact
from tritonclient.grpc import model_config_pb2 as pb

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import sha256_file
from xdeploy.deploy.embedder import Embedder
from xdeploy.deploy.registry import open_runner
from xdeploy.export.artifact import load_artifact
from xdeploy.serve.triton import TritonOptions, parse_pbtxt, write_repository

TYPES = {"int64": pb.TYPE_INT64, "float32": pb.TYPE_FP32}


@pytest.fixture(scope="module")
def text_art(tmp_path_factory):
    return tiny_text_artifact(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def tiny_bert(tiny_export):
    return tiny_export("bert")


def cfg(repo: Path, model: str):
    c = parse_pbtxt((repo / model / "config.pbtxt").read_text())
    assert c.name == model
    return c


def test_text_repository_fields_match_manifest(text_art, tmp_path):
    art = load_artifact(text_art)
    repo = tmp_path / "repo"
    rec = write_repository(art, repo, TritonOptions(max_batch_size=16, instances=2, max_queue_delay_us=500,
                                                    tokenizer="graph"))
    assert rec.text and rec.name == "bert"
    assert sorted(p.name for p in repo.iterdir()) == ["bert", "bert_onnx", "bert_pooling", "bert_tokenizer",
                                                      "xdeploy-triton.json"]
    assert not list(tmp_path.glob(".*")), "temporary directory left behind"

    g = art.graph()
    onnx = cfg(repo, "bert_onnx")
    assert onnx.platform == "onnxruntime_onnx" and onnx.max_batch_size == 16
    assert [(i.name, i.data_type, list(i.dims)) for i in onnx.input] == [
        (t.name, TYPES[t.dtype], [-1]) for t in g.inputs]  # [batch, seq]: batch left out, seq dynamic
    assert [(o.name, o.data_type, list(o.dims)) for o in onnx.output] == [
        ("last_hidden_state", pb.TYPE_FP32, [-1, 32]), ("pooler_output", pb.TYPE_FP32, [32])]
    assert list(onnx.dynamic_batching.preferred_batch_size) == [4, 8, 16]
    assert onnx.dynamic_batching.max_queue_delay_microseconds == 500
    assert [(ig.count, ig.kind) for ig in onnx.instance_group] == [(2, pb.ModelInstanceGroup.KIND_CPU)]
    assert sha256_file(repo / "bert_onnx" / "1" / "model.onnx") == art.manifest["files"]["model.onnx"]

    # asked for: the tokenizer step is the artifact's tokenizer graph on the onnxruntime backend, extensions as
    # custom ops
    tok = cfg(repo, "bert_tokenizer")
    assert tok.platform == "onnxruntime_onnx" and not tok.backend and tok.max_batch_size == 16
    assert [(i.name, i.data_type, list(i.dims), list(i.reshape.shape), i.HasField("reshape")) for i in tok.input] == [
        ("text", pb.TYPE_STRING, [1], [], True)]  # [b, 1] from the ensemble -> the graph's text [b]
    assert [o.name for o in tok.output] == [t.name for t in g.inputs]
    lib = tok.model_operations.op_library_filename
    assert len(lib) == 1 and Path(lib[0]).is_file() and "onnxruntime_extensions" in lib[0]
    assert tok.optimization.graph.level == -1  # basic: ORT_ENABLE_ALL takes seconds on the vocabulary attribute
    assert (repo / "bert_tokenizer" / "1" / "model.onnx").read_bytes() == art.tokenizer_graph.read_bytes()
    assert not (repo / "bert_tokenizer" / "1" / "model.py").exists()
    assert cfg(repo, "bert").ensemble_scheduling.step[0].input_map["text"] == "TEXT"

    # by default the tokenizer step is HF tokenizers in a Python-backend model (exact: the Embedder's and the C++
    # runtime's ids), even though this artifact carries a tokenizer graph
    write_repository(art, tmp_path / "default", TritonOptions(max_batch_size=16))
    tok = cfg(tmp_path / "default", "bert_tokenizer")
    assert tok.backend == "python" and not tok.model_operations.op_library_filename
    assert (tmp_path / "default" / "bert_tokenizer" / "1" / "tokenizer.json").read_bytes() == (
        text_art / "tokenizer" / "tokenizer.json").read_bytes()
    assert not (tmp_path / "default" / "bert_tokenizer" / "1" / "model.onnx").exists()
    # the Python-backend tokenizer (HF tokenizers) stays for --graph-backend python (PyTriton's tritonserver)
    write_repository(art, tmp_path / "py", TritonOptions(max_batch_size=16, graph_backend="python"))
    tok = cfg(tmp_path / "py", "bert_tokenizer")
    assert tok.backend == "python" and tok.input[0].data_type == pb.TYPE_STRING and list(tok.input[0].dims) == [1]
    assert tok.parameters["max_length"].string_value == str(art.manifest["pooling"]["max_length"])  # 64
    assert [o.name for o in tok.output] == [t.name for t in g.inputs]
    assert (tmp_path / "py" / "bert_tokenizer" / "1" / "tokenizer.json").read_bytes() == (
        text_art / "tokenizer" / "tokenizer.json").read_bytes()
    # the Python-backend graph model's onnxruntime session leaves out what xdeploy's CPU sessions do
    assert cfg(tmp_path / "py", "bert_onnx").parameters["ort_disabled_optimizers"].string_value == \
        "SkipLayerNormFusion"

    pool = cfg(repo, "bert_pooling")
    assert pool.parameters["mode"].string_value == "mean" and pool.parameters["normalize"].string_value == "true"
    assert list(pool.output[0].dims) == [32]

    ens = cfg(repo, "bert")
    assert ens.platform == "ensemble" and ens.max_batch_size == 16 and (repo / "bert" / "1").is_dir()
    steps = ens.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["bert_tokenizer", "bert_onnx", "bert_pooling"]
    # every tensor a step reads is the ensemble input or produced by an earlier step
    produced = {"TEXT"}
    for s in steps:
        assert set(s.input_map.values()) <= produced, s.model_name
        produced |= set(s.output_map.values())
    assert "EMBEDDING" in produced and ens.output[0].name == "EMBEDDING" and list(ens.output[0].dims) == [32]
    record = json.loads((repo / "xdeploy-triton.json").read_text())
    assert record["graph_sha256"] == art.manifest["files"]["model.onnx"]


def _load_python_model(path: Path, name: str):
    """Import a repository's model.py with a minimal stand-in for Triton's `triton_python_backend_utils` (which
    only exists inside Triton's Python backend): tensors carry numpy arrays, responses carry tensors or an error."""
    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class Response:
        def __init__(self, output_tensors, error=None):
            self.outputs, self.error = {t.name: t.array for t in output_tensors}, error

    shim = types.SimpleNamespace(Tensor=Tensor, InferenceResponse=Response, TritonError=str,
                                 get_input_tensor_by_name=lambda req, n: Tensor(n, req[n]))
    sys.modules["triton_python_backend_utils"] = shim  # type: ignore[assignment]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["triton_python_backend_utils"]
    return mod.TritonPythonModel()


def test_repository_pipeline_gives_the_embedder_vectors(text_art, tmp_path):
    repo = tmp_path / "repo"
    write_repository(text_art, repo, TritonOptions(name="emb", graph_backend="python"))  # Python tokenizer step
    models = {}
    for m in ("emb_tokenizer", "emb_pooling"):
        models[m] = _load_python_model(repo / m / "1" / "model.py", m)
        models[m].initialize({"model_config": json.dumps(
            __import__("google.protobuf.json_format", fromlist=["x"]).MessageToDict(
                cfg(repo, m), preserving_proto_field_name=True)),
            "model_repository": str(repo / m), "model_version": "1"})
    texts = ["A man is playing a guitar.", "", "emoji 🎉 and 日本語", "long " * 200, "x"]
    requests = [{"TEXT": np.array([[t.encode()] for t in texts[:3]], dtype=object)},
                {"TEXT": np.array([[t.encode()] for t in texts[3:]], dtype=object)},
                {"TEXT": np.array([[b"\xff\xfe not utf-8"]], dtype=object)}]
    tok_out = models["emb_tokenizer"].execute(requests)
    assert tok_out[2].error and "utf-8" in tok_out[2].error  # bad request: an error response, others served
    assert all(r.outputs["input_ids"].shape[1] % 8 == 0 for r in tok_out[:2])  # pad_to 8
    assert tok_out[1].outputs["input_ids"].shape[1] == 64  # the 200-word line is cut to max_length
    got = []
    with open_runner("ort", text_art) as ort:
        for r in tok_out[:2]:
            hidden = ort.infer(r.outputs)["last_hidden_state"]
            got.append(models["emb_pooling"].execute([{"last_hidden_state": hidden,
                                                       "attention_mask": r.outputs["attention_mask"]}])[0])
    vecs = np.concatenate([g.outputs["EMBEDDING"] for g in got])
    with Embedder(text_art) as e:
        np.testing.assert_allclose(vecs, e.embed(texts), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_tokenizer_graph_step_gives_the_embedder_vectors(text_art, tmp_path):
    """The generated tokenizer step as Triton's onnxruntime backend runs it (its model.onnx in an ORT session with
    the op library of its config registered, the [b, 1] text reshaped to [b]), then the graph and the pooling
    step: the vectors of Embedder(tokenizer="graph") and of the HF-tokenized Embedder (inputs the graph
    tokenizes like HF)."""
    import onnxruntime as ort

    repo = tmp_path / "repo"
    write_repository(text_art, repo, TritonOptions(name="emb", tokenizer="graph"))
    tcfg = cfg(repo, "emb_tokenizer")
    so = ort.SessionOptions()
    so.register_custom_ops_library(tcfg.model_operations.op_library_filename[0])
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # config level -1
    tok = ort.InferenceSession(str(repo / "emb_tokenizer" / "1" / "model.onnx"), so,
                               providers=["CPUExecutionProvider"])
    pool = _load_python_model(repo / "emb_pooling" / "1" / "model.py", "emb_pooling")
    pool.initialize({"model_config": json.dumps(__import__("google.protobuf.json_format", fromlist=["x"]).MessageToDict(
        cfg(repo, "emb_pooling"), preserving_proto_field_name=True))})
    texts = ["A man is playing a guitar.", "", "Café naïve résumé", "emoji 🎉", "long " * 200, "x"]
    # what the ensemble passes: TEXT [b, 1], which the config reshapes to the graph's [b]; Triton hands the bytes
    # to ONNX Runtime as they are, the Python binding needs str (it would str() a bytes object)
    batch = np.array([[t] for t in texts], dtype=object)
    outs = dict(zip([o.name for o in tcfg.output], tok.run([o.name for o in tcfg.output],
                                                            {"text": batch.reshape(len(texts))})))
    assert outs["input_ids"].shape == (len(texts), 64)  # padded to the longest: the 200-word line, cut to 64
    with open_runner("ort", text_art) as r:
        hidden = r.infer(outs)["last_hidden_state"]
    vecs = pool.execute([{"last_hidden_state": hidden, "attention_mask": outs["attention_mask"]}])[0].outputs[
        "EMBEDDING"]
    with Embedder(text_art, tokenizer="graph") as g, Embedder(text_art) as h:
        np.testing.assert_allclose(vecs, g.embed(texts), atol=1e-5)
        np.testing.assert_allclose(vecs, h.embed(texts), atol=1e-5)


def test_plain_graph_accelerators_and_engine(tiny_bert, tmp_path):
    rec = write_repository(tiny_bert, tmp_path / "r1", TritonOptions(accelerator="openvino", threads=2))
    assert not rec.text and rec.models == ("bert",)  # no tokenizer: just the graph, tensors in
    c = cfg(tmp_path / "r1", "bert")
    assert [a.name for a in c.optimization.execution_accelerators.cpu_execution_accelerator] == ["openvino"]
    assert c.parameters["intra_op_thread_count"].string_value == "2"

    write_repository(tiny_bert, tmp_path / "r2", TritonOptions(kind="gpu", accelerator="tensorrt", instances=3))
    c = cfg(tmp_path / "r2", "bert")
    acc = c.optimization.execution_accelerators.gpu_execution_accelerator[0]
    # an fp32 artifact stays FP32 (#18: it was given FP16); the engine cache is keyed by the graph's sha256
    assert acc.name == "tensorrt" and acc.parameters["precision_mode"] == "FP32"
    sha = load_artifact(tiny_bert).manifest["files"]["model.onnx"]
    assert acc.parameters["trt_engine_cache_path"] == f"/tmp/triton-trt-cache/bert-fp32-{sha[:16]}"
    axes = load_artifact(tiny_bert).spec.axes  # profile over the manifest's axes, batch capped at max_batch_size
    b, sq = axes["batch"], axes["seq"]
    assert acc.parameters["trt_profile_min_shapes"] == ",".join(
        f"{n}:{b.min}x{sq.min}" for n in ("input_ids", "attention_mask", "token_type_ids"))
    assert acc.parameters["trt_profile_max_shapes"].startswith(f"input_ids:{min(b.max, 32)}x{sq.max},")
    assert [(ig.count, ig.kind) for ig in c.instance_group] == [(3, pb.ModelInstanceGroup.KIND_GPU)]

    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"serialized engine bytes")
    write_repository(tiny_bert, tmp_path / "r3", TritonOptions(kind="gpu", engine=str(plan)))
    c = cfg(tmp_path / "r3", "bert")
    assert c.platform == "tensorrt_plan" and c.default_model_filename == "model.plan"
    assert (tmp_path / "r3" / "bert" / "1" / "model.plan").read_bytes() == plan.read_bytes()


@pytest.mark.parametrize("opts, msg", [
    (TritonOptions(accelerator="tensorrt"), "runs on GPU instances"),
    (TritonOptions(kind="gpu", accelerator="openvino"), "CPU execution accelerator"),
    (TritonOptions(max_batch_size=65), r"max_batch_size must be 1\.\.64"),
    (TritonOptions(preferred_batch_sizes=(4, 64)), "preferred batch sizes"),
    (TritonOptions(kind="tpu"), "unknown instance kind"),
    (TritonOptions(engine="/nonexistent.plan", kind="gpu"), "does not exist"),
    (TritonOptions(name="bad name!"), "model name"),
    (TritonOptions(graph_backend="python", accelerator="openvino"), "graph-backend python runs onnxruntime on CPU"),
    (TritonOptions(graph_backend="tf"), "unknown graph backend"),
    (TritonOptions(tokenizer="spm"), "unknown tokenizer"),
    (TritonOptions(tokenizer="graph"), "has no tokenizer graph; export it with --tokenizer-graph"),
])
def test_bad_options_are_one_line_errors(tiny_bert, tmp_path, opts, msg):
    with pytest.raises(XDeployError, match=msg):
        write_repository(tiny_bert, tmp_path / "r", opts)
    assert not (tmp_path / "r").exists()


def test_cli(tiny_bert, tmp_path, capsys):
    out, js = tmp_path / "repo", tmp_path / "rec.json"
    assert main(["triton", str(tiny_bert), "--out", str(out), "--max-batch-size", "8", "--json", str(js)]) == 0
    assert cfg(out, "bert").max_batch_size == 8 and json.loads(js.read_text())["max_batch_size"] == 8
    assert main(["triton", str(tiny_bert), "--out", str(out)]) == 2  # exists, no --force
    assert "already exists" in capsys.readouterr().err
    assert main(["triton", str(tiny_bert), "--out", str(out), "--preferred-batch-sizes", "a,b"]) == 2
    assert main(["triton", str(tiny_bert), "--out", str(out), "--force", "--max-batch-size", "4"]) == 0
    assert cfg(out, "bert").max_batch_size == 4


def test_generated_ensemble_runs_on_a_real_triton_server(text_art, tmp_path):
    """The repository itself on the tritonserver bundled with PyTriton (Python backend only, so the graph runs in
    the repository's Python-backend onnxruntime model): Triton parses every config.pbtxt, schedules the ensemble
    tokenizer -> graph -> pooling, and answers strings with the Embedder's vectors."""
    import psutil
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from serve_env import require_serve_env
    from tritonclient.utils import InferenceServerException

    from xdeploy.serve.server import ServerProcess

    require_serve_env()
    repo = tmp_path / "repo"
    write_repository(text_art, repo, TritonOptions(graph_backend="python", max_batch_size=8, max_queue_delay_us=3000))
    texts = ["A man is playing a guitar.", "", "emoji 🎉 and 日本語", "fox " * 100, "x", "Tabs\tand\nnewlines"]
    with ServerProcess(repo, repository=True, log=tmp_path / "triton.log") as srv, Embedder(text_art) as emb:
        assert srv.options.model_name == "bert"
        with tg.InferenceServerClient(srv.grpc_url) as c:  # Triton's view of our config equals the file
            served = c.get_model_config("bert_onnx").config
            assert served.max_batch_size == 8 and [i.name for i in served.input] == [
                "input_ids", "attention_mask", "token_type_ids"]
            assert list(served.dynamic_batching.preferred_batch_size) == [4, 8]
            assert served.parameters["ort_disabled_optimizers"].string_value == "SkipLayerNormFusion"

        def call(k: int) -> np.ndarray:
            batch = texts[k % 3:k % 3 + 1 + k % 4]
            if k % 2:
                with tg.InferenceServerClient(srv.grpc_url) as c:
                    inp = tg.InferInput("TEXT", [len(batch), 1], "BYTES")
                    inp.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=object))
                    got = c.infer("bert", [inp]).as_numpy("EMBEDDING")
            else:
                with th.InferenceServerClient(srv.http_url) as c:
                    inp = th.InferInput("TEXT", [len(batch), 1], "BYTES")
                    inp.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=object))
                    got = c.infer("bert", [inp]).as_numpy("EMBEDDING")
            np.testing.assert_allclose(got, emb.embed(batch), atol=2e-6, rtol=0)
            return got

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            assert len(list(pool.map(call, range(18)))) == 18
        with th.InferenceServerClient(srv.http_url) as c:
            inp = th.InferInput("TEXT", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[b"\xff not utf-8"]], dtype=object))
            with pytest.raises(InferenceServerException, match="utf-8"):
                c.infer("bert", [inp])
        call(5)  # still serving
        procs = [psutil.Process(srv.pid), *psutil.Process(srv.pid).children(recursive=True)]
        assert any(p.name() == "tritonserver" for p in procs)
        assert srv.stop() == 0
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [(p.pid, p.name()) for p in alive]
