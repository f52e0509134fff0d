"""The grouped interleaved comparison: candidates opened one by one beside an open baseline and compared in
memory-sized groups, each group with the baseline in its own rounds (bench/interleave.py), so every speed-up
stays paired.

All candidates at once may not fit in memory (GPT-2 small: twelve runner x precision sessions at batch 8, or 14
generators with their prefill and decode sessions, were killed on a 24 GB machine). So the open group is
compared and closed when it holds `max_group` candidates, or when the memory left is less than two more would
take (bench/memory.py `room_for_two_more`: the most one has taken so far, plus 1 GiB). The baseline stays open
throughout. Used by `xdeploy bench` (bench/suite.py compare_child) and the main job's decoding (bench/decode.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .interleave import Comparison
from .memory import current_rss, room_for_two_more

Call = Callable[[], Any]


@dataclass(frozen=True)
class Group:
    """One compared group: its number (1-based), its comparison (the baseline's rounds beside the group's) and the
    names first measured in it (the baseline's in the first group only, then the group's candidates)."""

    number: int
    comparison: Comparison
    names: tuple[str, ...]


def grouped_comparison(names: Sequence[str], open_one: Callable[[contextlib.ExitStack, str], Call],
                       measure: Callable[[dict[str, Call], str | None], Comparison],
                       judge: Callable[[Group], None], failed: Callable[[str, Exception], None], *,
                       baseline: str | None = None,
                       catch: type[Exception] | tuple[type[Exception], ...] = Exception,
                       max_group: int | None = None, memory_limit: float | None = None,
                       unit: Callable[[str], str] | None = None) -> int:
    """Compare `names` (the baseline first, whatever its place) in groups; returns how many groups were compared.

    `open_one(stack, name)` opens one candidate, entering what must be closed into `stack`, and returns the call
    to time. One that raises `catch` is passed to `failed(name, error)` (which may raise: a baseline that is
    required) and left out; the others are still compared. `measure(calls, baseline)` runs the interleaved
    comparison of one group (the baseline, when it opened, first among `calls`), and `judge(group)` turns it into
    results while the group is still open (a record may need one more call). Consecutive names with the same
    `unit(name)` (the instances of one system, studies/peers_generate.py) are never split between groups: a
    group closes only before a name that starts another unit."""
    order = sorted(names, key=lambda n: n != baseline)  # the baseline first: it is in every group
    calls: dict[str, Call] = {}
    measured: set[str] = set()
    groups = 0
    cost = 0.0  # the most one candidate has added to this process's memory so far
    # the group's stack closes first, then the baseline's (a closed ExitStack takes the next group)
    with contextlib.ExitStack() as base_stack, contextlib.ExitStack() as group_stack:
        for name in order:
            members = [n for n in calls if n != baseline]
            full = max_group is not None and len(members) >= max_group
            same_unit = unit is not None and bool(members) and unit(name) == unit(members[-1])
            if members and not same_unit and (full or not room_for_two_more(cost, memory_limit)):
                groups = _compare_group(calls, baseline, groups, measured, measure, judge)
                group_stack.close()  # close the group; the baseline stays
                for n in members:
                    calls.pop(n)
                gc.collect()
            rss0 = current_rss()
            try:
                with contextlib.ExitStack() as one:  # what a failed open left open is closed at once
                    call = open_one(one, name)
                    (base_stack if name == baseline else group_stack).enter_context(one.pop_all())
            except catch as e:
                failed(name, e)
                continue
            calls[name] = call
            cost = max(cost, current_rss() - rss0)
        if calls and (groups == 0 or any(n != baseline for n in calls)):
            groups = _compare_group(calls, baseline, groups, measured, measure, judge)
    return groups


def _compare_group(calls: dict[str, Call], baseline: str | None, groups: int, measured: set[str],
                   measure: Callable[[dict[str, Call], str | None], Comparison],
                   judge: Callable[[Group], None]) -> int:
    cmp = measure(dict(calls), baseline if baseline in calls else None)
    new = tuple(n for n in calls if n not in measured)  # the baseline's figures come from the first group
    measured.update(new)
    judge(Group(groups + 1, cmp, new))
    return groups + 1
