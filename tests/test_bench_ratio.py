"""The one rule every printed speed ratio follows (dflash2/bench/ratio.py): a gain (or loss) is claimed only when
its spread cannot explain it; otherwise the line says `no measurable difference`."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

from dflash2.bench.ratio import describe_ratio, pass_of, ratio_cell, ratio_of, spread


def test_a_spread_covering_one_is_no_measurable_difference():
    assert describe_ratio([0.97, 1.09], 1.03, over="ABBA pairs") == \
        "no measurable difference (0.97-1.09x over 2 ABBA pairs)"
    assert ratio_cell([0.97, 1.09], 1.03) == "no diff 0.97-1.09"


def test_a_tight_gain_is_the_gain_with_its_range():
    assert describe_ratio([1.27, 1.35], 1.31, over="ABBA pairs") == "1.31x (range 1.27-1.35x over 2 ABBA pairs)"
    assert ratio_cell([1.27, 1.35], 1.31) == "1.31x 1.27-1.35"
    assert describe_ratio([0.80, 0.84], 0.82) == "0.82x (range 0.80-0.84x over 2 runs)"  # a loss, the same rule


def test_a_range_wider_than_the_gain_is_no_measurable_difference():
    """The issue's number: 1.28x on a busy machine with the drafter skipped in 100 of 108 rounds; the two ABBA pairs
    disagree by more than the gain, so it is not shown as one even though both pairs are above 1."""
    assert describe_ratio([1.02, 1.61], 1.28, over="ABBA pairs").startswith("no measurable difference (1.02-1.61x")


def test_one_sample_says_it_has_no_spread():
    assert describe_ratio([1.4]) == "1.40x (one run: no spread measured)"
    assert ratio_cell([1.4]) == "1.40x ?" and spread([1.4]) == [] and spread([1.1, 1.3]) == [1.1, 1.3]
    assert not ratio_of([1.4]).measurable and ratio_of([0.0, 1.2]).n == 1  # 0: a mode that produced nothing
    assert describe_ratio([], 0.95) == "0.95x (no spread recorded)"  # a result file written before the spread


def test_a_printed_gain_is_never_larger_than_its_printed_spread():
    rng = random.Random(0)
    for _ in range(2000):
        samples = [rng.uniform(0.7, 1.6) for _ in range(rng.choice([2, 3, 4]))]
        line = describe_ratio(samples, sum(samples) / len(samples))
        lo, hi = map(float, re.search(r"(\d\.\d\d)-(\d\.\d\d)x", line).groups())
        if not line.startswith("no measurable difference"):
            gain = float(line.split("x", 1)[0])
            assert (lo > 1 or hi < 1) and hi - lo <= abs(gain - 1) + 0.01, line  # + rounding of the printed digits


def test_passes_are_repeats_or_halves_of_the_prompts():
    assert [pass_of(i, 0, 1) for i in range(4)] == [0, 1, 0, 1]
    assert [pass_of(i, r, 3) for i in range(2) for r in range(3)] == [0, 1, 2, 0, 1, 2]


def _gen(tokens: int, seconds: float, acceptance: float = 2.0):
    rounds = round(tokens / acceptance)
    return SimpleNamespace(stats=SimpleNamespace(new_tokens=tokens + 1, decode_seconds=seconds, rounds=rounds,
                                                 acceptance_length=tokens / rounds))


def test_the_demo_line_carries_the_abba_spread():
    from dflash2.cli.demo import speed_lines

    # ABBA: spec, base, base2, spec2; the pairs (spec, base) and (spec2, base2) give 1.40x and 1.00x
    noisy = speed_lines(_gen(127, 1.0), _gen(127, 1.4), _gen(127, 1.0), _gen(127, 1.0))
    assert "no measurable difference (1.00-1.40x over 2 ABBA pairs)" in noisy and "target-only tokens/s" in noisy
    tight = speed_lines(_gen(127, 1.0), _gen(127, 1.5), _gen(127, 1.55), _gen(127, 1.0))
    assert "1.52x (range 1.50-1.55x over 2 ABBA pairs)" in tight


def test_a_gain_above_what_acceptance_allows_is_not_claimed():
    """The demo on a busy machine: both ABBA pairs at 1.10x, acceptance 1.01 (the drafter skipped in 105 of 109
    rounds): the two modes did the same work, so the gain is the machine's, however tight the pairs."""
    line = describe_ratio([1.10, 1.11], 1.10, over="ABBA pairs", ceiling=1.01)
    assert line.startswith("no measurable difference") and "1.01x" in line
    assert ratio_cell([1.10, 1.11], 1.10, 1.01).startswith("no diff")
    assert describe_ratio([1.10, 1.11], 1.10, over="ABBA pairs", ceiling=1.8).startswith("1.10x (range")
    assert describe_ratio([0.90, 0.91], 0.90, ceiling=1.01).startswith("0.90x")  # a loss is never capped
    assert describe_ratio([1.10, 1.11], 1.10, ceiling=0.0).startswith("1.10x")  # 0: no rounds, unknown
    from dflash2.cli.demo import speed_lines

    busy = speed_lines(_gen(111, 1.0, 1.01), _gen(111, 1.1), _gen(111, 1.1), _gen(111, 1.0, 1.01))
    assert "no measurable difference (1.10x, above the 1.01x its acceptance length allows" in busy
