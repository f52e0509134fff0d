"""studies/round_noise.py: the noise comparison's settings and the --cost pairing, on tiny artifacts (the figures
themselves are docs/benchmarks.md's, taken on a quiet machine)."""

from __future__ import annotations

import pytest

from xdeploy.export.artifact import load_artifact
from xdeploy.studies import round_noise


def test_cost_pairs_each_onnxruntime_candidate_with_its_no_spin_twin(tiny_export) -> None:
    pytest.importorskip("openvino")
    arts = {p: load_artifact(tiny_export("bert", precision=p)) for p in ("fp32", "int8-dynamic")}
    res = round_noise.cost(round_noise.SETTINGS["run-spin"], arts, batch=1, rounds=3, threads=1)
    assert set(res["speedup"]) == {"fp32", "int8-dynamic"}  # one paired speed-up per onnxruntime candidate
    for v in res["speedup"].values():
        assert 0 < v["low"] <= v["median"] <= v["high"]
    assert res["other_cores"] >= 0
    # the settings a comparison can be opened with reach the runner as options
    assert round_noise.SETTINGS["run-spin"].ort == {"spin_between_runs": False}
    assert round_noise.SETTINGS["no-spin"].ort == {"spinning": False}
