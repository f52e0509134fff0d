"""Generate deploy/cpp/src/hf_unicode_compat.inc: where Hugging Face tokenizers' Unicode data differs from utf8proc's.

Hugging Face `tokenizers` takes its character classes from Rust crates with frozen tables (unicode_categories:
Cc/Cf/Co "other", Mn, P*; unicode-normalization-alignments: NFD) and its case mapping and whitespace from Rust's
std (a newer Unicode). The C++ tokenizer (src/wordpiece.cpp) uses utf8proc for all of them, so for every code point
this script asks both sides the same questions and writes the code points where they disagree:

  kSpaceFlip, kOtherFlip, kMnFlip, kPunctFlip   membership differs (the C++ side flips utf8proc's answer)
  kNfdOverride, kLowerOverride                  Hugging Face's canonical decomposition / lowercase of the code point

utf8proc's side comes from `xdeploy-tokenize --unicode-dump` (the raw library data, before overrides); Hugging
Face's from its own normalizers and pre-tokenizer, one code point at a time. Run after changing either library:

    .venv/bin/python deploy/cpp/tools/gen_hf_unicode_compat.py deploy/cpp/build/xdeploy-tokenize
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import normalizers, pre_tokenizers

OUT = Path(__file__).resolve().parents[1] / "src" / "hf_unicode_compat.inc"
WHITE_SPACE = {*range(0x9, 0xE), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
               0x3000}  # src/wordpiece.cpp is_white_space before its flips
CAT_MN, CAT_PC, CAT_PO, CAT_CC, CAT_CF, CAT_CO = 6, 12, 18, 26, 27, 29  # utf8proc_category_t


def ascii_punct(c: int) -> bool:
    return 0x21 <= c <= 0x2F or 0x3A <= c <= 0x40 or 0x5B <= c <= 0x60 or 0x7B <= c <= 0x7E


def utf8proc_data(binary: Path) -> tuple[str, dict[int, tuple[int, tuple[int, ...], int]]]:
    version = subprocess.run([str(binary), "--unicode-version"], capture_output=True, text=True, check=True).stdout
    dump = subprocess.run([str(binary), "--unicode-dump"], capture_output=True, text=True, check=True).stdout
    data = {}
    for line in dump.splitlines():
        cp, cat, nfd, low = line.split(" ")
        data[int(cp, 16)] = (int(cat), tuple(int(x, 16) for x in nfd.split(",")), int(low, 16))
    return version.split()[2], data


def hf_data(c: int) -> tuple[bool, bool, bool | None, bool, tuple[int, ...], tuple[int, ...]]:
    """(whitespace, other, Mn or None when the code point decomposes, punctuation, NFD, lowercase) per HF."""
    ch = chr(c)
    pieces = len(PRE.pre_tokenize_str("a" + ch + "a"))
    space, punct = pieces == 2, pieces == 3
    other = c not in (0, 0xFFFD) and CLEAN.normalize_str(ch) == ""
    nfd = tuple(map(ord, NFD.normalize_str(ch)))
    mn = STRIP.normalize_str(ch) == "" if nfd == (c,) else None
    low = tuple(map(ord, LOWER.normalize_str(ch)))
    return space, other, mn, punct, nfd, low


CLEAN = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=False)
STRIP = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True, lowercase=False)
NFD, LOWER, PRE = normalizers.NFD(), normalizers.Lowercase(), pre_tokenizers.BertPreTokenizer()


def table(name: str, cps: list[int]) -> str:
    rows = [", ".join(f"0x{c:X}" for c in cps[i:i + 10]) + "," for i in range(0, len(cps), 10)]
    return f"const u32 {name}[] = {{  // {len(cps)} code points\n" + "".join(f"    {r}\n" for r in rows) + \
        "    0xFFFFFFFF};\n"


def mappings(name: str, m: dict[int, tuple[int, ...]]) -> str:
    out = f"const Mapping {name}[] = {{  // {len(m)} code points\n"
    for c, to in sorted(m.items()):
        assert 0 < len(to) <= 4, (hex(c), to)
        out += f"    {{0x{c:X}, {len(to)}, {{{', '.join(f'0x{x:X}' for x in to + (0,) * (4 - len(to)))}}}}},\n"
    return out + "    {0xFFFFFFFF, 0, {0, 0, 0, 0}}};\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary", type=Path, help="deploy/cpp/build/xdeploy-tokenize")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    version, u = utf8proc_data(a.binary)
    flips: dict[str, list[int]] = {"kSpaceFlip": [], "kOtherFlip": [], "kMnFlip": [], "kPunctFlip": []}
    nfd_over: dict[int, tuple[int, ...]] = {}
    low_over: dict[int, tuple[int, ...]] = {}
    for c, (cat, nfd, low) in sorted(u.items()):
        space, other, mn, punct, hnfd, hlow = hf_data(c)
        if space != (c in WHITE_SPACE):
            flips["kSpaceFlip"].append(c)
        if c not in (0, 0x9, 0xA, 0xD, 0xFFFD) and other != (cat in (CAT_CC, CAT_CF, CAT_CO)):  # those: tested first
            flips["kOtherFlip"].append(c)
        if mn is not None and mn != (cat == CAT_MN):
            assert c >= 0x300, hex(c)  # src/wordpiece.cpp tests Mn from U+0300 on
            flips["kMnFlip"].append(c)
        if punct != (ascii_punct(c) or CAT_PC <= cat <= CAT_PO):
            flips["kPunctFlip"].append(c)
        if hnfd != nfd:
            assert c >= 0xC0, hex(c)  # src/wordpiece.cpp decomposes from U+00C0 on
            nfd_over[c] = hnfd
        if hlow != (low,):
            assert c >= 0x80, hex(c)  # ASCII is lowercased inline
            low_over[c] = hlow
    head = (f"// Generated by deploy/cpp/tools/gen_hf_unicode_compat.py: where Hugging Face tokenizers "
            f"{tokenizers.__version__}\n// differs from utf8proc (Unicode {version}); see that script. Do not edit.\n"
            f'const char* const kCompatUnicodeVersion = "{version}";\n')
    body = head + "".join(table(k, v) for k, v in flips.items()) + mappings("kNfdOverride", nfd_over) + \
        mappings("kLowerOverride", low_over)
    fd, tmp = tempfile.mkstemp(dir=a.out.parent, prefix=".compat-")
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.replace(tmp, a.out)
    print(f"{a.out}: utf8proc Unicode {version} vs tokenizers {tokenizers.__version__}: "
          + ", ".join(f"{k} {len(v)}" for k, v in flips.items())
          + f", kNfdOverride {len(nfd_over)}, kLowerOverride {len(low_over)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
