"""Every xdeploy command on every ONNX model of onnx's own backend test corpus (the onnx wheel carries it): a model a
user brings must end in a result or in one error line, never a traceback.

    python -m xdeploy.studies.onnx_corpus                      # all 149 models, 7 commands each (~4 min, 2 cores)
    python -m xdeploy.studies.onnx_corpus --limit 10 --commands parity,bench

The commands run in this process through the CLI's `main` (each model copied to a temporary directory first; xdeploy
never writes beside a user's file, the copy keeps the installed package out of reach anyway). A run is a *bug* when
`main` raises, exits with a code other than 0, 1 (a failed check) or 2 (a refusal), or refuses with other than
exactly one error line. Prints each run, then the exit codes per command and the bugs; exit 1 when there are bugs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

COMMANDS = {
    "parity": "parity {m}",
    "bench": "bench {m} --no-isolate --max-seconds 0.2 --min-iters 3 --max-iters 5 --warmup 1 --no-roofline",
    "fp16": "convert {m} --precision fp16 --out {w}/fp16",
    "int8-dynamic": "convert {m} --precision int8-dynamic --out {w}/int8-dynamic",
    "int8": "convert {m} --precision int8 --out {w}/int8 --no-sensitivity",
    "verify": "verify {w}/fp16",  # the fp16 conversion's result, where it was written
    "embed": "embed {m} --input {w}/text.txt --out {w}/vectors.npy",
}


def corpus() -> list[Path]:
    import onnx

    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    return sorted(root.glob("*/*/model.onnx")) + sorted(root.glob("light/*.onnx"))


def run_one(argv: list[str]) -> tuple[object, list[str], str | None]:
    """(exit code or "traceback", stderr lines, the traceback's text)."""
    from xdeploy.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc: object = main(argv)
    except SystemExit as e:
        rc = e.code
    except Exception:  # noqa: BLE001 - what this study looks for
        return "traceback", err.getvalue().splitlines(), traceback.format_exc()
    return rc, [x for x in err.getvalue().splitlines() if x.strip()], None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", default=",".join(COMMANDS), help=f"among {', '.join(COMMANDS)}")
    ap.add_argument("--limit", type=int, default=0, help="the first N models only (0: all)")
    a = ap.parse_args(argv)
    names = [c for c in a.commands.split(",") if c]
    if set(names) - set(COMMANDS):
        ap.error(f"--commands: expected names among {', '.join(COMMANDS)}")
    models = corpus()[: a.limit or None]
    codes: Counter[tuple[str, object]] = Counter()
    bugs: list[str] = []
    for model in models:
        label = model.parent.name if model.name == "model.onnx" else model.stem
        with tempfile.TemporaryDirectory(prefix="xdeploy-corpus-") as tmp:
            work = Path(tmp)
            (work / "m").mkdir()
            shutil.copy(model, work / "m" / model.name)
            (work / "text.txt").write_text("hello world\n")
            for name in names:
                argv_ = [x.replace("{m}", str(work / "m" / model.name)).replace("{w}", str(work))
                         for x in COMMANDS[name].split()]
                rc, lines, tb = run_one(argv_)
                codes[name, rc] += 1
                errors = [x for x in lines if "error" in x.lower()]
                if tb is not None:
                    bugs.append(f"{label} {name}: traceback\n{tb}")
                elif rc not in (0, 1, 2):
                    bugs.append(f"{label} {name}: exit {rc}")
                elif rc == 2 and len(errors) != 1:
                    bugs.append(f"{label} {name}: refused with {len(errors)} error lines: {lines[-3:]}")
                print(f"{label:36s} {name:13s} {rc!s:9s} {(lines[-1] if lines else '')[:140]}", flush=True)
    print(f"\n{len(models)} models x {len(names)} commands:")
    for (name, rc), n in sorted(codes.items(), key=str):
        print(f"  {name:13s} exit {rc!s:9s} {n}")
    print(f"bugs: {len(bugs)}")
    for b in bugs:
        print(b)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
