"""The C++ runtime installs as a CMake package: `cmake --install` into a temporary prefix, then a separate project
(deploy/cpp/examples/consumer) finds it with find_package(xdeploy), links xdeploy::embed, builds and runs: its
ids equal Hugging Face tokenizers'. Nothing from the source or build tree is on its include or link path."""

from __future__ import annotations

import subprocess

from cpp_build import CPP, build_cpp
from tiny_text import MINILM
from tokenizers import Tokenizer


def test_installed_package_builds_a_consumer(tmp_path):
    build = build_cpp()
    prefix = tmp_path / "prefix"
    r = subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = prefix / "lib" / "cmake" / "xdeploy"
    assert {p.name for p in cfg.iterdir()} >= {"xdeployConfig.cmake", "xdeployConfigVersion.cmake",
                                               "xdeployTargets.cmake"}
    assert (prefix / "include" / "xdeploy" / "tokenizer.hpp").is_file()
    assert (prefix / "bin" / "xdeploy-embed").is_file() and (prefix / "lib" / "libonnxruntime.so.1").exists()
    out = tmp_path / "consumer-build"
    for cmd in (["cmake", "-S", str(CPP / "examples" / "consumer"), "-B", str(out), f"-DCMAKE_PREFIX_PATH={prefix}",
                 "-DCMAKE_BUILD_TYPE=Release"], ["cmake", "--build", str(out), "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{cmd}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
    cache = (out / "CMakeCache.txt").read_text()
    assert f"xdeploy_DIR:PATH={cfg}" in cache and str(build) not in cache
    lines = ["Café au lait, s'il vous plaît!", "Hello [SEP] world", "日本語 🎉"]
    r = subprocess.run([str(out / "consumer"), str(MINILM / "tokenizer.json")], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, *ids = r.stdout.splitlines()
    assert first.startswith("onnxruntime 1.")
    hf = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    hf.no_padding()
    assert ids == [" ".join(map(str, hf.encode(s).ids)) for s in lines]
    # a version the package does not satisfy is refused by find_package
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.18)\nproject(b LANGUAGES CXX)\n"
                                        "find_package(xdeploy 9.0 REQUIRED)\n")
    r = subprocess.run(["cmake", "-S", str(bad), "-B", str(bad / "b"), f"-DCMAKE_PREFIX_PATH={prefix}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "xdeploy" in r.stderr


