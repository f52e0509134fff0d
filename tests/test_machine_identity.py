"""One definition of the same machine (core/fingerprint.py `machine_identity`): the journal's resume check, the
roofline cache and `machine_class` agree on every change to a fingerprint; this fails when one of them grows a
definition of its own again."""

from __future__ import annotations

import copy
from typing import Any

from xdeploy.bench import roofline
from xdeploy.core import journal
from xdeploy.core.fingerprint import MACHINE_FIELDS, fingerprint, machine_class, machine_identity


def _variants(fp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fingerprint with one part changed, for every part it has (nested thread settings and environment too)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in fp.items():
        if isinstance(value, dict):
            for sub in [*value, "added"]:
                v = copy.deepcopy(fp)
                v[key][sub] = "changed"
                out[f"{key}.{sub}"] = v
        else:
            out[key] = fp | {key: ["changed"] if isinstance(value, list) else "changed"}
    return out | {"record time": fp | {"timestamp": "another"}}


def test_the_journal_the_roofline_and_the_class_share_one_identity(tmp_path, monkeypatch) -> None:
    """For each change to this machine's fingerprint: the journal calls it a machine change, the roofline cache
    refuses its peaks, exactly when the identity changes; an unchanged identity never changes the class."""
    assert journal.machine_identity is machine_identity  # the journal keeps no definition of its own
    fp = fingerprint() | {"env": {"OMP_NUM_THREADS": "2"}}
    fp["threads"] = dict(fp["threads"], torch_intra_op=2)
    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path))
    monkeypatch.setattr(roofline, "fingerprint", lambda: fp)
    roofline.save(roofline.summarize([], quick=True))
    assert roofline.load() is not None
    variants = _variants(fp)
    # every part the identity reads is varied, and some it does not
    assert {"threads.affinity_cpus", "threads.torch_intra_op", "env.OMP_NUM_THREADS"} <= set(variants)
    assert set(MACHINE_FIELDS) <= {what.split(".")[0] for what in variants}
    same = 0
    for what, other in variants.items():
        monkeypatch.setattr(roofline, "fingerprint", lambda other=other: other)
        equal = machine_identity(other) == machine_identity(fp)
        assert (journal.identity_changes(machine_identity(fp), machine_identity(other)) == []) is equal, what
        assert (roofline.load() is not None) is equal, what
        if equal:
            same += 1
            assert machine_class(other) == machine_class(fp), what
    assert 0 < same < len(variants)  # both kinds of change were tried

