"""The C++ tokenizer (deploy/cpp/src/wordpiece.cpp) gives Hugging Face tokenizers' ids on the real MiniLM
tokenizer.json: every code point (in context, and the words WordPiece sees), a seeded fuzz corpus of 12,000 strings
across scripts and edge cases, the 43-input verification corpus, truncation, and invalid UTF-8 refused with the
byte offset Python's decoder names. One xdeploy-tokenize process per check, fed length-prefixed records."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import unicodedata
from pathlib import Path

import pytest
from cpp_build import build_cpp
from tiny_text import MINILM
from tokenizers import Tokenizer

TOKENIZER = MINILM / "tokenizer.json"
SPECIALS = ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"]
WHITESPACE = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u1680", "\u2000", "\u2007", "\u200a",
              "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\x1c", "\x1f"]
ZERO_WIDTH = ["\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u2060", "\ufeff", "\u00ad", "\u061c", "\u180e"]


@pytest.fixture(scope="module")
def tool() -> Path:
    return build_cpp() / "xdeploy-tokenize"


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    t = Tokenizer.from_file(str(TOKENIZER))
    t.no_padding()
    t.no_truncation()
    return t


def run_records(tool: Path, texts: list[bytes], *args: str) -> list[str]:
    data = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    r = subprocess.run([str(tool), str(TOKENIZER), "--records", *args], input=data, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")[:-1]
    assert len(lines) == len(texts)
    return lines


def cpp_ids(tool: Path, texts: list[str], *args: str) -> list[tuple[int, list[int]]]:
    out = []
    for line in run_records(tool, [t.encode() for t in texts], *args):
        assert not line.startswith("!"), line
        n, ids = line.split("\t")
        out.append((int(n), [int(x) for x in ids.split()]))
    return out


def first_differences(texts: list[str], got: list[list[int]], want: list[list[int]]) -> list[str]:
    return [f"{texts[i]!r}: C++ {got[i]} HF {want[i]}" for i in range(len(texts)) if got[i] != want[i]][:5]


def category_boundaries() -> list[str]:
    """Every code point whose general category differs from the one before it, and that one (Python's Unicode)."""
    out, prev = [], None
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        cat = unicodedata.category(chr(c))
        if cat != prev and c > 0:
            out += [chr(c - 1), chr(c)] if not 0xD800 <= c - 1 <= 0xDFFF else [chr(c)]
        prev = cat
    return out


def fuzz_corpus(n: int, seed: int = 28) -> list[str]:
    rng = random.Random(seed)
    vocab = list(json.loads(TOKENIZER.read_text())["model"]["vocab"])
    boundaries = category_boundaries()

    def rand_range(lo: int, hi: int, k: int) -> str:
        return "".join(chr(rng.randint(lo, hi)) for _ in range(k))

    pools = {
        "word": lambda: rng.choice(vocab).removeprefix("##"),
        "Word": lambda: rng.choice(vocab).removeprefix("##").upper() if rng.random() < 0.5
        else rng.choice(vocab).removeprefix("##").capitalize(),
        "pieces": lambda: "".join(rng.choice(vocab).removeprefix("##") for _ in range(rng.randint(2, 5))),
        "latin1": lambda: rand_range(0xC0, 0x24F, rng.randint(1, 8)),
        "greek": lambda: rand_range(0x370, 0x3FF, rng.randint(1, 8)) + rand_range(0x1F00, 0x1FFF, rng.randint(0, 3)),
        "cyrillic": lambda: rand_range(0x400, 0x52F, rng.randint(1, 8)),
        "arabic": lambda: rand_range(0x600, 0x6FF, rng.randint(1, 8)) + rand_range(0x8A0, 0x8FF, rng.randint(0, 2)),
        "hebrew": lambda: rand_range(0x591, 0x5F4, rng.randint(1, 6)),
        "indic": lambda: rand_range(0x900, 0xDFF, rng.randint(1, 8)),
        "thai_lao_tibetan": lambda: rand_range(0xE00, 0xFFF, rng.randint(1, 8)),
        "hangul": lambda: rand_range(0xAC00, 0xD7A3, rng.randint(1, 4)) + rand_range(0x1100, 0x11FF, rng.randint(0, 3)),
        "kana": lambda: rand_range(0x3040, 0x30FF, rng.randint(1, 6)) + rand_range(0xFF61, 0xFF9F, rng.randint(0, 2)),
        "cjk": lambda: "".join(chr(rng.choice([rng.randint(0x4E00, 0x9FFF), rng.randint(0x3400, 0x4DBF),
                                               rng.randint(0x20000, 0x2A6DF), rng.randint(0x2A6D0, 0x2A71F),
                                               rng.randint(0x2B730, 0x2B830), rng.randint(0x2B900, 0x2CEBF),
                                               rng.randint(0xF900, 0xFAFF), rng.randint(0x2F800, 0x2FA1F),
                                               rng.randint(0x30000, 0x3134F), 0x4DC0, 0x9FFF + 1, 0x33FF]))
                               for _ in range(rng.randint(1, 5))),
        "emoji": lambda: rng.choice(["🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🏳️‍🌈", "😀", "🧑🏿‍🚀", "#️⃣", "🫠"]),
        "marks": lambda: rng.choice("aeiouAEIOUnc") + rand_range(0x300, 0x36F, rng.randint(1, 4))
        + rand_range(0x1AB0, 0x1AFF, rng.randint(0, 2)) + rand_range(0x20D0, 0x20FF, rng.randint(0, 1)),
        "boundary": lambda: "".join(rng.choice(boundaries) for _ in range(rng.randint(1, 4))),
        "any": lambda: "".join(chr(c) for c in (rng.randint(0, 0x10FFFF) for _ in range(rng.randint(1, 4)))
                               if not 0xD800 <= c <= 0xDFFF),
        "bmp": lambda: "".join(chr(c) for c in (rng.randint(0x80, 0xFFFF) for _ in range(rng.randint(1, 6)))
                               if not 0xD800 <= c <= 0xDFFF),
        "control": lambda: "".join(chr(rng.choice([*range(0, 0x20), *range(0x7F, 0xA0), 0xFFFD, 0xFFFE, 0xFFFF,
                                                   0xE000, 0xF8FF, 0x10FFFD]))
                                   for _ in range(rng.randint(1, 3))),
        "zero_width": lambda: rng.choice(ZERO_WIDTH),
        "nul": lambda: "\0" * rng.randint(1, 2),
        "punct": lambda: "".join(rng.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~¡¿«»–—‘’“”…‹›、。「」・〜￥") for _ in
                                 range(rng.randint(1, 4))),
        "math": lambda: rand_range(0x2200, 0x22FF, rng.randint(1, 3)) + rand_range(0x1D400, 0x1D7FF, rng.randint(0, 2)),
        "fullwidth": lambda: rand_range(0xFF01, 0xFF5E, rng.randint(1, 6)),
        "long": lambda: rng.choice(["a", "ab", "é", "x1", "ü"]) * rng.randint(48, 130),
        "longword": lambda: "".join(rng.choice("abcdefghij") for _ in range(rng.choice([99, 100, 101, 150, 300]))),
        "special": lambda: rng.choice(SPECIALS),
        "special_like": lambda: rng.choice(["[SEP", "SEP]", "[sep]", "[[SEP]]", "[SEP][SEP]", "[CLS][MASK]",
                                            "[ CLS ]", "x[MASK]y", "[MASK]]", "[[UNK]", "[PAD]s", "［SEP］"]),
        "digits": lambda: str(rng.randint(0, 10 ** rng.randint(1, 15))) + rng.choice(["", ".5", ",000", "٣", "७"]),
    }
    names = list(pools)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts.append(pools[rng.choice(names)]())
            parts.append(rng.choice(["", " ", " ", " ", rng.choice(WHITESPACE), rng.choice(WHITESPACE) * 2]))
        out.append("".join(parts))
    return out


def test_fuzz_ids_equal_hugging_face(tool, hf):
    """12,000 generated strings: ids equal HF's exactly (no truncation, so every token counts), and the count
    before truncation is HF's length."""
    from xdeploy.export.tokenizer_graph import TOKENIZER_CORPUS

    texts = fuzz_corpus(12000) + list(TOKENIZER_CORPUS)
    assert len(set(texts)) > 11500
    # the corpus reaches what it claims to: specials, NUL, zero-width, words over 100 characters, CJK, marks
    joined = "".join(texts)
    for needle in ["[SEP]", "[CLS]", "[MASK]", "[PAD]", "[UNK]", "\0", "\u200b", "\ufeff", "\u0301", "\u4e00"[:0]]:
        assert needle in joined
    assert sum(len(w) > 100 for t in texts for w in t.split()) > 100
    want = [e.ids for e in hf.encode_batch(texts)]
    got = cpp_ids(tool, texts)
    assert [n for n, _ in got] == [len(w) for w in want]
    diffs = first_differences(texts, [g for _, g in got], want)
    assert not diffs, f"{sum(g != w for (_, g), w in zip(got, want))} differ, e.g. " + "\n".join(diffs)
    assert sum(100 in w for w in want) > 1000 and sum(102 in w[1:-1] for w in want) > 100  # [UNK], [SEP] in text


def test_truncation_equals_hugging_face(tool, hf):
    """max_length cuts like HF's longest_first/right truncation ([CLS] + first tokens + [SEP]) and counts the
    tokens before the cut."""
    texts = fuzz_corpus(1000, seed=7)
    full = [e.ids for e in hf.encode_batch(texts)]
    for max_length in (2, 16, 64):
        hf.enable_truncation(max_length, strategy="longest_first", direction="right")
        try:
            want = [e.ids for e in hf.encode_batch(texts)]
        finally:
            hf.no_truncation()
        got = cpp_ids(tool, texts, "--max-length", str(max_length))
        assert [g for _, g in got] == want, max_length
        assert [n for n, _ in got] == [len(f) for f in full]
        # the cut is exercised at every length (of the 1000 texts 991 are longer than 2 tokens, 283 than 16, 56 than 64)
        assert sum(n > max_length for n, _ in got) > 50


def test_every_code_point_equals_hugging_face(tool, hf):
    """Every code point of planes 0-3 and 14-16 (all assigned and private-use ones) and every 64th of planes 4-13
    (unassigned as of Unicode 16), 256 to a string, each between two letters ("a{c}b"): the words WordPiece sees
    (normalized and pre-tokenized; WordPiece itself is checked by the fuzz test) equal HF's. This is where the
    Unicode-version overrides (src/hf_unicode_compat.inc) are proven: utf8proc alone differs from HF on 626 code
    points."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and (not 0x40000 <= c < 0xE0000 or c % 64 == 0)]
    assert len(cps) > 450_000
    texts = [" ".join(f"a{chr(c)}b" for c in cps[i:i + 256]) for i in range(0, len(cps), 256)]
    data = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    r = subprocess.run([str(tool), str(TOKENIZER), "--records", "--words"], input=data, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    got_words = r.stdout.decode().split("\n")[:-1]
    norm, pre = hf.normalizer, hf.pre_tokenizer
    bad = []
    for t, line in zip(texts, got_words, strict=True):
        want = " ".join(w.encode().hex() for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)))
        if line != want:
            bad.append(t)
    assert not bad, f"{len(bad)} strings differ in words, e.g. {bad[0][:200]!r}"


def test_invalid_utf8_names_the_byte_offset(tool, hf):
    """Invalid UTF-8 is refused per text with Python's offset of the first bad byte; random byte strings that
    happen to be valid are tokenized like HF."""
    rng = random.Random(5)
    cases = [b"\xff", b"ok \xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc", b"abc\xc3",
             b"caf\xc3\xa9 \xe9", b"\xf0\x9f\x8e", "é".encode() * 50 + b"\xfe"]
    cases += [bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 24))) for _ in range(2000)]
    cases += [bytes(rng.choice(b"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 ab") for _ in range(rng.randint(1, 16)))
              for _ in range(2000)]
    lines = run_records(tool, cases)
    valid = 0
    for i, (b, line) in enumerate(zip(cases, lines, strict=True)):
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError as e:
            assert line == f"!text {i} is not valid UTF-8 (byte {e.start})", (b, line)
            continue
        valid += 1
        assert line.split("\t")[1] == " ".join(map(str, hf.encode(s).ids)), (b, line)
    assert 100 < valid < len(cases) - 1000


def test_the_cli_refuses_bad_tokenizers_in_one_line(tool, tmp_path):
    tj = json.loads(TOKENIZER.read_text())
    cases = {
        "bpe": ({**tj, "model": {"type": "BPE", "vocab": {}, "merges": []}}, "model type \"BPE\" is not supported; "
                                                                             "expected WordPiece"),
        "norm": ({**tj, "normalizer": {"type": "NFKC"}}, "normalizer type \"NFKC\" is not supported; expected "
                                                         "BertNormalizer"),
        "pre": ({**tj, "pre_tokenizer": {"type": "ByteLevel"}}, "pre_tokenizer type \"ByteLevel\" is not supported"),
        "post": ({**tj, "post_processor": {"type": "RobertaProcessing"}}, "post_processor type \"RobertaProcessing\""),
        "added": ({**tj, "added_tokens": [{**tj["added_tokens"][0], "normalized": True}]}, "\"normalized\": true"),
        "unk": ({**tj, "model": {**tj["model"], "unk_token": "<unk>"}}, "unk_token \"<unk>\" is not in the vocab"),
        "shape": ({**tj, "model": {**tj["model"], "vocab": [1, 2]}}, "vocab is not an object"),
        "field": ({**tj, "model": {k: v for k, v in tj["model"].items() if k != "unk_token"}},
                  "missing or mistyped field"),
    }
    for name, (obj, msg) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(obj))
        r = subprocess.run([str(tool), str(p)], input=b"hello\n", capture_output=True, timeout=60)
        err = r.stderr.decode()
        assert r.returncode == 2 and msg in err and len(err.strip().splitlines()) == 1, (name, err)
    (tmp_path / "garbage.json").write_text("{oops")
    r = subprocess.run([str(tool), str(tmp_path / "garbage.json")], input=b"x\n", capture_output=True, timeout=60)
    assert r.returncode == 2 and b"is not JSON" in r.stderr
