"""The main job's memory guard (run policy beside xdeploy/pipeline.py): before each configuration, its estimated
peak (bench/memory.py `estimate_peak`) against the memory available now; what does not fit is left out with a
note ("skipped: needs ≈X GiB, Y GiB available") and the job goes on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class RunMemoryGuard:
    """`notes(text)` is told every configuration left out (the report lists them), `on_skip(phase, what, why)`
    too, and also a whole step left out (the journal records it, so a resume knows it was not forgotten)."""

    def __init__(self, memory_limit: float | None, on_skip: Callable[[str, str, str], None],
                 notes: Callable[[str], None] = lambda _text: None) -> None:
        from xdeploy.bench.memory import MemoryGuard

        self.on_skip, self.notes = on_skip, notes
        self.guard = MemoryGuard(memory_limit)
        self._arts: dict[Path, Any] = {}  # fp32 artifacts read so far (every estimate of a step reads the same one)

    def _art(self, fp32: Path) -> Any:
        """The fp32 artifact, read once per guard (its files were verified when exported or reused)."""
        key = Path(fp32)
        if key not in self._arts:
            from xdeploy.export.artifact import load_artifact

            self._arts[key] = load_artifact(key, verify=False)
        return self._arts[key]

    def _skip(self, phase: str, what: str, note: str) -> None:
        self.notes(f"{phase} {what}: {note}")
        self.on_skip(phase, what, note)

    @staticmethod
    def _weights(fp32: Path) -> float:
        """fp32 weights in bytes: the fp32 artifact's ONNX files (graph + external data)."""
        return float(sum(p.stat().st_size for p in Path(fp32).iterdir() if p.suffix in (".onnx", ".data")
                         or p.name.endswith(".onnx.data")))

    def _caps(self, fp32: Path) -> Any:
        """The model's declared capabilities (its token axes name the sizes of an estimate)."""
        return self._art(fp32).capabilities

    def estimate(self, fp32: Path, sizes: dict[str, int], **kw: Any) -> Any:
        """MemoryEstimate of the model of the fp32 artifact at these axis sizes (inputs it does not use dropped)."""
        from xdeploy.bench.memory import estimate_peak, output_elems

        art = self._art(fp32)
        g = art.graph("model")
        used = {d for t in g.inputs for d in t.dims if isinstance(d, str)}
        sizes = {k: v for k, v in sizes.items() if k == "batch" or k in used}
        return estimate_peak(art.config, sizes, weights_fp32_bytes=self._weights(fp32),
                             output_elems=output_elems(g, sizes), **kw)

    def bench(self, model: str, preset: str, fp32: Path, batches: Sequence[int], seqs: Sequence[int]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The batches and seqs (every token axis) whose every combination fits (estimates grow with both)."""
        from xdeploy.models.spec import token_sizes

        caps = self._caps(fp32)

        def note(b: int, t: int) -> str | None:
            return self.guard.check(self.estimate(fp32, token_sizes(caps, b, t)))

        keep_s = [t for t in seqs if note(min(batches), t) is None]
        keep_b = [b for b in batches if all(note(b, t) is None for t in keep_s)]
        for b in batches:
            for t in seqs:
                if b not in keep_b or t not in keep_s:
                    self._skip("bench", f"{model} {preset} batch {b} seq {t}", note(b, t) or
                               "skipped: its batch/seq row has a configuration that does not fit")
        if not keep_b or not keep_s:
            self.on_skip("bench", f"{model} {preset}", "every configuration skipped by the memory guard")
            return (), ()
        return tuple(keep_b), tuple(keep_s)

    def parity(self, model: str, preset: str, prec: str, fp32: Path,
               shapes: Sequence[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        """The parity shapes that fit (parity runs in this process)."""
        from xdeploy.models.spec import token_count

        caps = self._caps(fp32)
        keep = []
        for b, t in shapes:
            est, sizes = self.parity_estimate(fp32, b, t)
            why = self.guard.check(est)
            if why is None:
                keep.append((b, t))
            else:
                self._skip("parity", f"{model} {preset} {prec} shape {b}x{token_count(caps, sizes) or '-'}", why)
        if not keep:  # the whole step: the journal knows it was not forgotten
            self.on_skip("parity", f"{model} {preset} {prec}", "every parity shape skipped by the memory guard")
        return keep

    def parity_estimate(self, fp32: Path, batch: int, seq: int | None) -> tuple[Any, dict[str, int]]:
        """(MemoryEstimate, sizes) of one parity shape: the reference model in this process besides the runner,
        and float64 copies of the outputs (reference, candidate, difference, ratio)."""
        from xdeploy.bench.memory import WEIGHT_COPIES, output_elems
        from xdeploy.models.spec import token_sizes

        art = self._art(fp32)
        caps = art.capabilities
        axis = art.spec.axes.get(caps.token_axis) if caps.token_axis is not None else None
        sizes = token_sizes(caps, batch, seq or axis.max) if axis is not None else {"batch": batch}
        f64 = 4 * 8.0 * output_elems(art.graph("model"), sizes)
        return self.estimate(fp32, sizes, weight_copies=WEIGHT_COPIES + 1, extra_bytes=f64), sizes

    def decode_estimate(self, fp32: Path, prompt: int, new: int) -> Any:
        """Decoding runs in this process: the reference and one runner, a KV cache of prompt + new tokens."""
        from xdeploy.bench.memory import WEIGHT_COPIES
        from xdeploy.models.registry import dims

        kv = 2.0 * dims(self._art(fp32).config).kv_bytes(prompt + new)  # past and present copies
        caps = self._caps(fp32)
        sizes = {"batch": 1} | ({caps.token_axis: prompt + new} if caps.token_axis is not None else {})
        sizes |= {caps.source_axis: prompt} if caps.source_axis is not None else {}  # an encoder-decoder's source
        return self.estimate(fp32, sizes, weight_copies=WEIGHT_COPIES + 1, extra_bytes=kv)

    def decode(self, model: str, preset: str, fp32: Path, prompt: int, new: int) -> str | None:
        """Why decoding does not fit (skipped, with a note), or None."""
        why = self.guard.check(self.decode_estimate(fp32, prompt, new))
        if why is not None:
            self._skip("decode", f"{model} {preset}", why)
        return why

    def decode_group(self, fp32: Path, prompt: int, new: int) -> int:
        """How many generators may be open at once beside the PyTorch baseline (at least one): the decode
        estimate holds the baseline and one runner; every further runner adds WEIGHT_COPIES of the weights."""
        from xdeploy.bench.memory import WEIGHT_COPIES

        spare = self.guard.available() - self.decode_estimate(fp32, prompt, new).total
        return max(1, 1 + int(spare // (WEIGHT_COPIES * self._weights(fp32))))

    def scale_max_t(self, model: str, preset: str, max_t: int) -> int | None:
        """The largest T of the sweep up to `max_t` whose materialized scores fit; None when not even the
        smallest does."""
        from xdeploy.bench.memory import estimate_peak
        from xdeploy.bench.scale import t_values
        from xdeploy.models.registry import get_config, get_family, param_count
        from xdeploy.models.spec import token_sizes

        caps = get_family(model).capabilities
        c = get_config(model, preset)
        w = 4.0 * param_count(model, c)
        ts = t_values(max_t)
        for t in ts:
            why = self.guard.check(estimate_peak(c, token_sizes(caps, 1, t), weights_fp32_bytes=w))
            if why is not None:
                self._skip("scale", f"{model} T={t}" + (f"..{ts[-1]}" if t != ts[-1] else ""), why)
                if t == ts[0]:
                    self.on_skip("scale", model, "every T skipped by the memory guard")
                    return None
                return ts[ts.index(t) - 1]
        return ts[-1]
