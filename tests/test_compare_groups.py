"""`xdeploy bench`'s comparison child opens its candidates in groups when memory runs short (twelve GPT-2 small
sessions at batch 8 were killed on a 24 GB machine); every group is timed with the baseline in its own rounds,
so each candidate's speed-up is still a paired one."""

from __future__ import annotations

from tests.families import first
from xdeploy.bench.memory import LIMIT_ENV, Probe
from xdeploy.bench.suite import CompareJob, bench_configs, compare_child
from xdeploy.export.artifact import load_artifact


def test_compare_child_groups_candidates_when_memory_is_short(tiny_export, monkeypatch):
    path = tiny_export(first())
    sizes = bench_configs(load_artifact(path), (1,), (8,))[0][0]
    names = ("torch fp32", "ort fp32", "ov fp32")
    job = CompareJob(candidates=tuple((n, n.split()[0], str(path)) for n in names), sizes=tuple(sizes.items()),
                     baseline="torch fp32", threads=1, warmup=1, min_rounds=3, max_rounds=4, max_seconds=0.3,
                     attempts=1)
    monkeypatch.setenv(LIMIT_ENV, "1")  # one byte "available": each candidate beside the baseline is its own group
    out = compare_child(Probe(), job)
    assert not out["failures"] and set(out["results"]) == set(names) and out["groups"] == 2
    groups = set()
    for n in names[1:]:
        st = out["results"][n]["stability"]
        assert st["baseline"] == "torch fp32" and st["rounds"] >= 3
        assert st["speedup"]["low"] <= st["speedup"]["median"] <= st["speedup"]["high"]
        groups.add(st["group"])
    assert groups == {1, 2}
    # engines are opened as they are timed beside others: onnxruntime's pool does not spin between calls
    assert out["results"]["ort fp32"]["stability"]["options"] == {"spin_between_runs": False}
    assert out["results"]["ov fp32"]["stability"]["options"] == {}
    monkeypatch.delenv(LIMIT_ENV)  # enough memory: one group, as before
    assert compare_child(Probe(), job)["groups"] == 1


def test_grouped_comparison_never_splits_the_instances_of_one_system(monkeypatch):
    """With no memory to spare every candidate is its own group, but the instances of one system (one `unit`) stay
    in one group: the generation study's tie band pairs instance 1 and 2 by round (studies/peers_generate.py)."""
    from xdeploy.bench.groups import grouped_comparison

    names = ["hf", "ort", "ort #2", "ov", "ov #2", "ct2"]
    monkeypatch.setenv(LIMIT_ENV, "1")

    def groups(unit):
        seen = []
        grouped_comparison(names, lambda _stack, n: (lambda: n), lambda calls, _baseline: list(calls),
                           lambda g: seen.append(g.comparison), lambda n, e: None, baseline="hf", unit=unit)
        return seen

    assert groups(None) == [["hf", "ort"], ["hf", "ort #2"], ["hf", "ov"], ["hf", "ov #2"], ["hf", "ct2"]]
    assert groups(lambda n: n.split(" #")[0]) == [["hf", "ort", "ort #2"], ["hf", "ov", "ov #2"], ["hf", "ct2"]]
