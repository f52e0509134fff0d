"""Executable docs: every shell and Python block of README.md and docs/*.md runs, so a doc cannot drift from the code.

How a page runs (the rule is also in README.md, "Executable docs"):
- Blocks fenced ```sh / ```bash / ```shell run in bash (`set -eo pipefail`), ```python / ```py blocks in this
  interpreter, in page order, in one scratch directory per page (links to this checkout's files, its own
  artifacts/ and reports/), so a page's later blocks use what its earlier blocks made. A new page or a new block
  is picked up automatically.
- Big presets become tiny ones and long jobs their short modes, by the substitutions in SUBSTITUTIONS below
  (printed with each block that changed), so that the whole of it fits in `make test`.
- A block that must not run says so in the markdown, on the line before its fence:
  `<!-- doc-test: skip: REASON -->` (needs a GPU, Docker, runs until Ctrl-C, a synopsis, ...). Illustrative
  output and synopses are better fenced as ```text, which is never run. An unlabeled fence that starts like a
  command is an error: label it ```sh (run) or ```text (not run).
"""

from __future__ import annotations

import functools
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL, PYTHON = ("sh", "bash", "shell"), ("python", "py")
SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(?P<reason>\S.*?)\s*-->")
COMMANDISH = re.compile(r"^\s*(\$ |xdeploy |python |make |from \w|import \w|cmake |curl |docker )")

# (pattern, replacement, why): applied in order to the text of every block that runs.
QUICK_RUN = "--smoke --models vit --skip roofline,bench,decode,scale"  # export + parity + report of one tiny model
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    (r"--preset[ =](?!tiny\b)[\w-]+", "--preset tiny", "tiny presets: seconds, not minutes"),
    (r"preset=\"(?!tiny\")[\w-]+\"", 'preset="tiny"', "tiny presets (Python)"),
    (r"--seq 128\b", "--seq 16", "short sequences"),
    (r"(\bxdeploy run\b.*?) --full\b", r"\1", "the main job's smallest mode, not the base presets"),
    (r"\bxdeploy run(?![\w-])(?!.*--smoke)(?!.*--models)", f"xdeploy run {QUICK_RUN}", "the main job's smallest mode"),
    (r"\bxdeploy run(?![\w-])(?!.*--smoke)", "xdeploy run --smoke --skip roofline,bench,decode,scale",
     "the main job's smallest mode"),
    # a documented smoke run with every phase (docs/report.md): its bench was 24 of its 31 s (the memory children:
    # one per runner, precision and batch) and the whole of it tests/test_report.py's smoke test, which runs the
    # same job's bench on both CPU runners with its assertions; the roofline has its own blocks
    # (docs/benchmarks.md) and tests
    (r"(?m)(\bxdeploy run\b(?!.*--skip)(?!.*--runners)(?!.*--precision).*--smoke\b[^#\n]*?)([ \t]*(#.*)?)$",
     r"\1 --skip roofline,bench\2", "a smoke run without its bench (tests/test_report.py's smoke test runs it)"),
    (r"\bmake demo\b(?!.*DEMO_ARGS)", f'make demo DEMO_ARGS="{QUICK_RUN}"', "the main job's smallest mode"),
    (r"\bxdeploy roofline(?![\w-])(?!.*--quick)", "xdeploy roofline --quick", "the quick roofline"),
    (r"\bxdeploy scale(?![\w-])(?!.*--smoke)", "xdeploy scale --smoke", "the scaling sweep's smallest mode"),
    # fp32 only: the job's conversions and their parity are the CLI blocks' and tests/test_report.py's (~12 s of
    # CPU for a Python block that names two models)
    (r"RunConfig\(", 'RunConfig(smoke=True, presets={"*": "tiny"}, skip=("roofline", "bench", "decode", "scale"), '
     'precisions=("fp32",), ', "the main job's smallest mode, fp32 only (Python)"),
    # after the rules above: --smoke alone keeps the default presets (bert minilm: its int8 sensitivity search
    # alone is ~25 s of CPU); the main job on the tiny presets runs the same phases and code
    (r"\bxdeploy run(?![\w-])(?!.*--preset)", "xdeploy run --preset tiny", "tiny presets (the main job)"),
    # a benchmark block checks that its command runs and writes its records, not the figures: short timings
    # (`xdeploy bench`'s defaults time each comparison 5 s, plus up to 30 s more while it is unstable)
    (r"\bxdeploy bench(?![\w-])(?!.*--max-seconds)", "xdeploy bench --max-seconds 0.5 --extra-seconds 0",
     "short timings"),
    # a Python benchmark over several sequence lengths: the first only (each length is its own comparison, a child
    # process and its memory children: ~7 s each here), as `--seq 128` becomes `--seq 16` above
    (r"\bseqs=\[(\d+)(?:, *\d+)+\]", r"seqs=[\1]", "one sequence length (Python)"),
    (r"(?m)^(from xdeploy\.bench\.suite import .*\brun_bench\b.*)$",
     r"\1\nimport functools; run_bench = functools.partial(run_bench, max_seconds=0.5)", "short timings (Python)"),
]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason given in the markdown


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence[:3]):
            j += 1
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.search(prev)
        out.append(Block(str(path.relative_to(ROOT)), i + 1, lang, "\n".join(lines[i + 1:j]) + "\n",
                         skip.group("reason") if skip else None))
        i = j + 1
    return out


def substitute(code: str) -> tuple[str, list[str]]:
    applied = []
    for pat, rep, why in SUBSTITUTIONS:
        new = re.sub(pat, rep, code)
        if new != code:
            applied.append(f"{pat!r} -> {rep!r} ({why})")
            code = new
    return code, applied


def _scratch(tmp: Path) -> Path:
    """A directory that looks like this checkout (links) but has its own artifacts/ and a copy of reports/."""
    work = tmp / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in ("artifacts", "reports", ".git") or entry.name.startswith(".pytest"):
            continue
        (work / entry.name).symlink_to(entry)
    # reports/ is copied, not linked: a block may write a report (even over reports/reference, as docs/report.md
    # shows), and nothing a doc block does may reach the checkout
    shutil.copytree(ROOT / "reports", work / "reports", ignore=shutil.ignore_patterns("latest", "__pycache__"))
    return work


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    # README.md, docs/embedding.md and docs/serving.md each export the real MiniLM checkpoint with the same command:
    # its artifact (ONNX, OpenVINO IR, reference weights) is ~260 MB, over the cache's default 256 MB per entry, so
    # without this every page exported it again (~20 s of CPU each) instead of copying the first page's export
    env.setdefault("XDEPLOY_EXPORT_CACHE_MAX_MB", "1024")
    return env


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_block(b: Block, work: Path, timeout: float = 600) -> tuple[float, float, list[str]]:
    """Run one block; returns its wall and CPU seconds (CPU: robust to a loaded machine) and the substitutions
    applied to it."""
    code, applied = substitute(b.code)
    if b.lang in SHELL:
        cmd = ["bash", "-c", "set -eo pipefail\n" + code]
    else:
        script = work / f".doc-block-{b.line}.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    t0, c0 = time.perf_counter(), _children_cpu_s()
    r = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    elapsed, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        subs = "".join(f"\n  substituted: {a}" for a in applied)
        pytest.fail(f"{b.page}:{b.line} ({b.lang} block) exited {r.returncode}{subs}\n--- block as run:\n{code}"
                    f"--- output (last lines):\n{tail}", pytrace=False)
    return elapsed, cpu, applied


ALL = [b for p in pages() for b in blocks(p)]
RUNNABLE = [p for p in pages() if any(b.lang in SHELL + PYTHON for b in blocks(p))]


def test_every_page_is_found_and_has_blocks():
    assert len(pages()) >= 2 and ALL
    assert any(b.lang in PYTHON for b in ALL) and any(b.lang in SHELL for b in ALL)


def test_unlabeled_blocks_that_look_like_commands_are_labeled():
    """A command in an unlabeled fence is neither run nor marked: label it ```sh (run) or ```text (not run)."""
    bad = [f"{b.page}:{b.line}" for b in ALL if not b.lang and COMMANDISH.match(b.code)]
    assert not bad, f"unlabeled command blocks (fence them as ```sh to run or ```text for a synopsis): {bad}"


def test_skipped_blocks_give_a_reason_and_are_runnable_kinds():
    for b in ALL:
        if b.skip is not None:
            assert b.lang in SHELL + PYTHON, f"{b.page}:{b.line}: a skip marker on a block that never runs"
            assert len(b.skip) >= 8, f"{b.page}:{b.line}: say why the block does not run"


def test_substitutions_are_visible_and_do_what_they_say():
    code, applied = substitute('xdeploy run --full --out x\nxdeploy export bert --preset base\n'
                               'export("gpt", preset="small")\nxdeploy run --smoke\n')
    assert code == (f'xdeploy run --preset tiny {QUICK_RUN} --out x\nxdeploy export bert --preset tiny\n'
                    'export("gpt", preset="tiny")\nxdeploy run --preset tiny --smoke --skip roofline,bench\n')
    assert len(applied) == 6
    assert substitute("run_bench('bert', batches=[1, 8], seqs=[32, 128])\n")[0] == \
        "run_bench('bert', batches=[1, 8], seqs=[32])\n"
    assert substitute("run_bench('bert', seqs=[64])\n")[0] == "run_bench('bert', seqs=[64])\n"  # one length: as given
    # a smoke run that names its phases, runners or precisions runs as written; a comment stays a comment
    assert substitute("xdeploy run --smoke --runners ort\n")[0] == "xdeploy run --preset tiny --smoke --runners ort\n"
    assert substitute("xdeploy run --smoke --models vit  # why\n")[0] == \
        "xdeploy run --preset tiny --smoke --models vit --skip roofline,bench  # why\n"
    assert substitute("xdeploy report render x")[0] == "xdeploy report render x"  # not `xdeploy run`
    assert substitute("xdeploy bench bert --runners ort\n")[0] == \
        "xdeploy bench --max-seconds 0.5 --extra-seconds 0 bert --runners ort\n"
    assert substitute("xdeploy bench x --max-seconds 1\n")[0] == "xdeploy bench x --max-seconds 1\n"  # as given
    code, applied = substitute("from xdeploy.bench.suite import run_bench\nrun_bench('bert', runners=['ort'])\n")
    assert code == ("from xdeploy.bench.suite import run_bench\n"
                    "import functools; run_bench = functools.partial(run_bench, max_seconds=0.5)\n"
                    "run_bench('bert', runners=['ort'])\n") and len(applied) == 1


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The fragment ids GitHub gives a page's headings: lower case, punctuation other than "-" and "_" dropped,
    spaces to hyphens; a repeated heading gets "-1", "-2", ... Fenced blocks have no headings."""
    out: set[str] = set()
    count: dict[str, int] = {}
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = count.get(slug, 0)
            count[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def test_relative_links_reach_a_file_and_heading():
    """Every relative link of every page names a file of this checkout (a report moved or renamed breaks it) and,
    for a page, one of its headings (a renamed section breaks it)."""
    bad = []
    for page in pages():
        for m in re.finditer(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            url = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:
                continue
            path, _, frag = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.relative_to(ROOT)}: {url} (no such file)")
            elif frag and target.suffix == ".md" and frag not in anchors(target):
                bad.append(f"{page.relative_to(ROOT)}: {url} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_page_runs(page, tmp_path, capsys):
    work = _scratch(tmp_path)
    ran = skipped = 0
    for b in blocks(page):
        if b.lang not in SHELL + PYTHON:
            continue
        if b.skip is not None:
            line = f"doc block not run: {b.page}:{b.line} ({b.skip})"
            skipped += 1
        else:
            elapsed, cpu, applied = run_block(b, work)
            line = (f"doc block ran: {b.page}:{b.line} ({b.lang}) {elapsed:.1f} s wall, {cpu:.1f} s CPU"
                    + "".join(f"\n    substituted: {a}" for a in applied))
            ran += 1
        with capsys.disabled():  # in the test log as it happens: what ran (time, substitutions), what did not
            print(f"\n  {line}", end="", flush=True)
    assert ran or skipped
    shutil.rmtree(work / "artifacts", ignore_errors=True)
