"""How PyTorch's OpenMP threads behave when another process takes a core (issue #15, "no oversubscription").

Each (wait policy, threads) case runs in a fresh interpreter (OpenMP reads its environment once, when torch
loads it), timing a BERT-layer-sized workload (4 x [128 x 384] @ [384 x 1536] and back, fp32) in rounds,
once on the machine as it is and once while `python -c 'while True: pass'` holds a core.

    .venv/bin/python -m xdeploy.studies.omp_policy [--seconds 3]

Prints median ms per call and the slow-down the busy process causes; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, torch
threads, seconds = int(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(threads)
x = torch.randn(128, 384); w1 = torch.randn(384, 1536); w2 = torch.randn(1536, 384)
def call():
    h = x
    for _ in range(4):
        h = torch.relu(h @ w1) @ w2
    return h
with torch.inference_mode():
    for _ in range(5): call()
    ts = []; t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(ts) < 20:
        t0 = time.perf_counter(); call(); ts.append(time.perf_counter() - t0)
ts.sort()
print(json.dumps({"median_s": ts[len(ts) // 2], "n": len(ts)}))
"""

POLICIES: dict[str, dict[str, str]] = {
    "default": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=0": {"GOMP_SPINCOUNT": "0"},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def _run(env_extra: dict[str, str], threads: int, seconds: float) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | env_extra
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(seconds)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["median_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    for name, env in POLICIES.items():
        for th in threads:
            quiet = _run(env, th, args.seconds)
            busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.2)
                busy = _run(env, th, args.seconds)
            finally:
                busy_proc.kill()
                busy_proc.wait()
            rows.append({"policy": name, "threads": th, "quiet_ms": quiet * 1e3, "busy_ms": busy * 1e3,
                         "slowdown": busy / quiet})
            print(f"{name:26s} threads={th}: {quiet * 1e3:7.2f} ms as is, {busy * 1e3:7.2f} ms with a busy core "
                  f"({busy / quiet:.2f}x)", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
