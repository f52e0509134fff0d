"""The AVX2-only class (AMD Zen 3), run on whatever machine runs the tests: QEMU user mode gives a process Zen 3's
CPUID, so numpy, onnxruntime and OpenVINO pick that class's kernels (verify/emulate.py). What used to be a model of
the class (export/saturation.py) is checked against the class's own kernels here, and an artifact's golden probes
run on it (`xdeploy verify --emulate avx2`).

Skipped without qemu-user >= 10 (the reason names the install), unless XDEPLOY_REQUIRE_EMULATION=1 (.ci/run sets
it): then a missing emulator fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import confirmed_isa
from xdeploy.verify import emulate

ROOT = Path(__file__).resolve().parents[1]


def _emulator_or_skip() -> None:
    try:
        emulate.emulator("avx2")
    except XDeployError as e:
        if os.environ.get("XDEPLOY_REQUIRE_EMULATION") == "1":
            raise
        pytest.skip(str(e))


def _run(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = emulate.run_emulated("avx2", ["-c", code, *args], timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


ZEN4_FLAGS = ["avx2", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512f", "fma", "sha_ni"]
ZEN3_CPUID = {"AVX2": True, "FMA3": True, "AVX512F": False, "AVX512BW": False, "AVX512VNNI": False,
              "AVX512BF16": False}


def test_cpuid_decides_the_isa_over_proc_cpuinfo():
    """/proc/cpuinfo is the host's under QEMU: what CPUID denies goes (AMX with AVX-512), and an emulated process
    keeps only what CPUID confirms; natively a flag numpy cannot check (sha_ni) stays."""
    assert confirmed_isa(ZEN4_FLAGS, ZEN3_CPUID, emulated=False) == ["avx2", "fma", "sha_ni"]
    assert confirmed_isa(ZEN4_FLAGS, ZEN3_CPUID, emulated=True) == ["avx2", "fma"]
    assert confirmed_isa(ZEN4_FLAGS + ["amx_int8"], ZEN3_CPUID, emulated=False) == ["avx2", "fma", "sha_ni"]
    zen4 = ZEN3_CPUID | {"AVX512F": True, "AVX512BW": True, "AVX512VNNI": True, "AVX512BF16": True}
    assert confirmed_isa(ZEN4_FLAGS, zen4, emulated=False) == ZEN4_FLAGS
    assert confirmed_isa(ZEN4_FLAGS, None, emulated=True) == ZEN4_FLAGS  # no CPUID reading: /proc/cpuinfo alone


def test_emulator_refuses_a_qemu_older_than_10(tmp_path, monkeypatch, capsys):
    """QEMU 7.2 (Debian 12's own) computes OpenVINO's AVX2 tanh wrongly: refused in one line naming the install,
    and `xdeploy doctor` says the class cannot be emulated here and why."""
    fake = tmp_path / "qemu-x86_64"
    fake.write_text("#!/bin/sh\necho 'qemu-x86_64 version 7.2.0 (Debian 1:7.2+dfsg-7+deb12u18)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(XDeployError, match=r"QEMU 7\.2\.0; .* needs QEMU >= 10\.0 .*bookworm-backports"):
        emulate.emulator("avx2")
    with pytest.raises(XDeployError, match="expected one of: avx2"):
        emulate.emulator("avx512")
    from xdeploy.cli import main

    assert main(["doctor"]) == 0
    assert "emulate  avx2: unavailable: " in capsys.readouterr().out


def test_the_emulated_process_is_the_avx2_class():
    """Its CPUID has AVX2 and no AVX-512, its fingerprint says so (int8 class avx2) and its machine class says
    "emulated": the host (any class) runs the AVX2-only class's kernels."""
    _emulator_or_skip()
    out = _run("import json; from numpy._core._multiarray_umath import __cpu_features__ as f; "
               "from xdeploy.core.fingerprint import fingerprint, int8_dot, machine_class; fp = fingerprint(); "
               "print(json.dumps({'avx2': f['AVX2'], 'avx512f': f['AVX512F'], 'isa': fp['isa'], "
               "'int8': int8_dot(fp), 'class': machine_class(fp)}))").stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["avx2"] and not got["avx512f"]
    assert got["int8"] == "avx2" and not any(f.startswith(("avx512", "amx")) for f in got["isa"])
    assert "emulated by QEMU as EPYC-Milan" in got["class"]


def test_saturation_model_is_the_avx2_kernel():
    """tests/test_int8_kernels.py, run as the AVX2 class: onnxruntime's own AVX2 int8 GEMM is bit-identical to
    export/saturation.py's pairwise model (8-bit weights saturate, 7-bit and uint8 are exact), a Q/DQ MatMul's int8
    activations are shifted to uint8 there too, and OpenVINO's int8 MatMul saturates 8-bit weights there like
    onnxruntime (exact with 7-bit). On a VNNI or AMX host these tests otherwise only see the exact product. (The ort
    runner's refusal of such a graph as this class: test_openvino_takes_int8_dynamic_8_bit_weights_on_avx2 below.)"""
    _emulator_or_skip()
    # no plugins: hypothesis and anyio alone took 7 s of a 30 s run to import as this class
    plugins = ("cacheprovider", "xdist", "xdist.looponfail", "hypothesispytest", "anyio")
    done = emulate.run_emulated("avx2", ["-m", "pytest", str(ROOT / "tests" / "test_int8_kernels.py"), "-q",
                                         *(a for p in plugins for a in ("-p", f"no:{p}"))], timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "8 passed" in done.stdout, done.stdout[-1000:]


def _verify(art: Path, runner: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xdeploy.cli", "verify", str(art), "--runner", runner,
                           "--emulate", "avx2"], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def int8_7_and_8_bit(tiny_export, tmp_path_factory):
    """A tiny GPT's default int8 conversion (7-bit weights), the same with 8-bit weights, its int8-dynamic conversion
    with 8-bit int8 weights everywhere, and its int8-dynamic conversion with 8-bit weight blocks (MatMulNBits)."""
    from xdeploy.api import convert_artifact
    from xdeploy.export.precision import PrecisionOptions

    src, root = tiny_export("gpt"), tmp_path_factory.mktemp("emulated")
    good = convert_artifact(src, root / "int8", "int8", measured=False)
    bad = convert_artifact(src, root / "int8-w8", "int8", measured=False, options=PrecisionOptions(int8_weight_bits=8))
    dyn = convert_artifact(src, root / "dyn-w8", "int8-dynamic", measured=False,
                           options=PrecisionOptions(int8_weight_bits=8, int8_dynamic_weights="int8"))
    blocks = convert_artifact(src, root / "blocks", "int8-dynamic", measured=False,
                              options=PrecisionOptions(int8_dynamic_weights="blocks"))
    return good, bad, dyn, blocks


@dataclass(frozen=True)
class Verdict:
    """One artifact's part of an emulated `xdeploy verify A B ...`: its stdout lines, its stderr error line (a
    refusal), its --json object."""
    out: str
    err: str
    record: dict


@pytest.fixture(scope="module")
def emulated_verdicts(int8_7_and_8_bit, tmp_path_factory):
    """runner -> {artifact: Verdict}: the artifacts of `int8_7_and_8_bit` (ov: all but the weight blocks) checked by
    ONE emulated `xdeploy verify` per runner (under QEMU the imports are most of a check's time: one process instead
    of one per artifact); the process's exit code is 1, as one of them is refused."""
    _emulator_or_skip()
    every = [Path(a) for a in int8_7_and_8_bit]
    verdicts = {}
    for runner, arts in (("ort", every), ("ov", every[:3])):  # the weight blocks are onnxruntime's MatMulNBits
        js = tmp_path_factory.mktemp("verdicts") / f"{runner}.json"
        done = subprocess.run([sys.executable, "-m", "xdeploy.cli", "verify", *map(str, arts), "--runner", runner,
                               "--emulate", "avx2", "--json", str(js)], capture_output=True, text=True, timeout=900)
        assert done.returncode == 1, done.stdout + done.stderr  # the 8-bit static int8 is refused on both
        records = json.loads(js.read_text())["artifacts"]
        assert [r["artifact"] for r in records] == list(map(str, arts))
        verdicts[runner] = {a: Verdict("".join(x for x in done.stdout.splitlines(keepends=True)
                                               if x.startswith(f"{a}: ")),
                                       "".join(x for x in done.stderr.splitlines(keepends=True)
                                               if x.startswith(f"xdeploy: error: {a}: ")), r)
                            for a, r in zip(arts, records)}
    return verdicts


@pytest.mark.parametrize("runner", ["ort", "ov"])
def test_verify_emulate_runs_the_probes_on_the_avx2_class(int8_7_and_8_bit, emulated_verdicts, runner):
    """`xdeploy verify --emulate avx2`: the default (7-bit) int8 export passes its golden probes as the AVX2 class;
    the same graph quantized with 8-bit weights is refused there (exit 1, naming the saturation), on both runtimes."""
    good, bad = (Path(a) for a in int8_7_and_8_bit[:2])
    v = emulated_verdicts[runner][good]
    assert v.record["passed"] and v.err == "", v
    assert f"pass on {runner}" in v.out and "emulated by QEMU as EPYC-Milan" in v.out
    v = emulated_verdicts[runner][bad]
    assert not v.record["passed"] and v.out == "", v
    assert "saturates" in v.err and "emulated by QEMU as EPYC-Milan" in v.err and "saturates" in v.record["error"]
    if runner == "ort":  # one artifact alone: the refusal is the command's error (exit 1), as before several existed
        done = _verify(bad, runner)
        assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
        assert "saturates" in done.stderr and "emulated by QEMU as EPYC-Milan" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_openvino_takes_int8_dynamic_8_bit_weights_on_avx2(int8_7_and_8_bit, emulated_verdicts):
    """int8-dynamic's MatMulInteger graph with 8-bit int8 weights: OpenVINO computes it in f32 (its golden probes
    pass as the AVX2 class, so ov does not refuse it; as on a real Zen 3 in issue #27), while onnxruntime's int8
    kernel would saturate it there: the ort runner's guard refuses it (deploy/saturation_guard.py, whose message this
    is; test_saturation.py's test_ort_refuses_saturating_int8_only_where_it_saturates checks it by fingerprint)."""
    dyn = Path(int8_7_and_8_bit[2])
    v = emulated_verdicts["ov"][dyn]
    assert v.record["passed"] and "pass on ov" in v.out and v.err == "", v
    v = emulated_verdicts["ort"][dyn]
    assert not v.record["passed"] and "which onnxruntime on this CPU" in v.err, v
    assert "saturates into wrong outputs" in v.err and "emulated by QEMU as EPYC-Milan" in v.err


def test_int8_blocks_decode_step_as_the_avx2_class(int8_7_and_8_bit, emulated_verdicts):
    """--int8-dynamic-weights blocks (onnxruntime's MatMulNBits, 8-bit weights): MLAS's AVX2 block kernel multiplies
    each weight byte alone in a 16-bit lane, so the decode step passes its probes as that class too."""
    blocks = Path(int8_7_and_8_bit[3])
    v = emulated_verdicts["ort"][blocks]
    assert v.record["passed"] and "pass on ort" in v.out and v.err == "", v


def test_ov_compiles_the_qdq_graph_where_the_int8_ir_would_saturate(tmp_path):
    """A static int8 artifact carrying NNCF's IR (8-bit weights past the first layer): as the AVX2 class the ov
    runner says on stderr that it compiles the 7-bit Q/DQ ONNX graph instead, and the probes pass; natively (this
    host has VNNI or AMX, or is the AVX2 class itself: then the same line) it compiles the IR."""
    _emulator_or_skip()
    from xdeploy import api
    from xdeploy.core.fingerprint import fingerprint, int8_dot
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import export

    src = export("bert", preset="tiny", out=tmp_path / "fp32", openvino_ir=True)
    art = load_artifact(api.convert_artifact(src, tmp_path / "int8", "int8"))
    if art.openvino_ir("model") is None:
        pytest.skip(f"the int8 IR failed its check on this machine: {art.manifest['openvino']['skipped']}")
    done = _verify(art.path, "ov")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiling the artifact's Q/DQ ONNX graph (7-bit weights) instead" in done.stderr
    native = subprocess.run([sys.executable, "-m", "xdeploy.cli", "verify", str(art.path), "--runner", "ov"],
                            capture_output=True, text=True, timeout=600)
    assert native.returncode == 0, native.stdout + native.stderr
    assert ("Q/DQ ONNX graph" in native.stderr) == (int8_dot(fingerprint()) == "avx2")


def test_cpp_runtime_as_the_avx2_class(tmp_path_factory):
    """The C++ runtime (deploy/cpp's xdeploy-embed, onnxruntime's C API) as the AVX2 class: it checks the artifact's
    golden probes at every start and passes them there, and its vectors equal the host's for a tiny text encoder at
    fp32 and at the default (7-bit) int8; an 8-bit int8 artifact is refused there, as the Python ort runner
    refuses it (its class read from CPUID, its proof from the manifest)."""
    _emulator_or_skip()
    from cpp_build import build_cpp
    from tiny_text import tiny_text_artifact

    from xdeploy.api import convert_artifact

    binary = build_cpp() / "xdeploy-embed"
    fp32 = tiny_text_artifact(tmp_path_factory.getbasetemp())
    int8 = convert_artifact(fp32, tmp_path_factory.mktemp("cpp-int8") / "int8", "int8", measured=False)
    ids = "101 2023 2003 1037 3231 102\n101 7592 2088 102\n101 102\n"
    for art in (fp32, int8):
        runs = [subprocess.run([*prefix, str(binary), str(art)], input=ids, capture_output=True, text=True,
                               timeout=600) for prefix in ([], emulate.emulator("avx2"))]
        for r in runs:
            assert r.returncode == 0 and "sentences -> " in r.stderr, r.stderr[-2000:]
        native, emulated = (np.array([[float(x) for x in line.split()] for line in r.stdout.splitlines()])
                            for r in runs)
        assert native.shape == emulated.shape == (3, native.shape[1])
        assert np.abs(native - emulated).max() <= 1e-5, (art, np.abs(native - emulated).max())
    # an int8 artifact with 8-bit weights (proven for vnni and amx only): refused as the AVX2 class (exit 1, one
    # line), run on the host when it is not that class, and run there too with --allow-saturation
    from xdeploy.core.fingerprint import fingerprint, int8_dot
    from xdeploy.export.precision import PrecisionOptions

    w8 = convert_artifact(fp32, tmp_path_factory.mktemp("cpp-int8-w8") / "int8", "int8", measured=False,
                          options=PrecisionOptions(int8_weight_bits=8))
    avx2 = emulate.emulator("avx2")
    r = subprocess.run([*avx2, str(binary), str(w8)], input=ids, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and r.stdout == "", r.stderr[-2000:]
    assert "is proven exact only on CPU classes [vnni, amx]" in r.stderr and "is class avx2" in r.stderr
    assert r.stderr.count("xdeploy-embed: error:") == 1
    r = subprocess.run([*avx2, str(binary), str(w8), "--allow-saturation"], input=ids, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r.stderr[-2000:]
    r = subprocess.run([str(binary), str(w8)], input=ids, capture_output=True, text=True, timeout=600)
    assert (r.returncode == 0) == (int8_dot(fingerprint()) != "avx2"), r.stderr[-2000:]
