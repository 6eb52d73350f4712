"""Weights on huge pages (ops/cpu_native/hugepages.py): the span arithmetic against a brute-force
page walk, and a real collapse that leaves the values and addresses as they were."""

import random
import sys

import pytest
import torch

from ops.cpu_native import hugepages
from ops.cpu_native.hugepages import PAGE


def brute_spans(ranges, mappings):
    """Page by page: a 2 MiB page is kept when it lies wholly inside the mapping holding a range's
    start and overlaps that range (clipped to the mapping)."""
    pages = set()
    for start, end in ranges:
        for m_start, m_end in mappings:
            if m_start <= start < m_end:
                for p in range(0, m_end + PAGE, PAGE):
                    inside = m_start <= p and p + PAGE <= m_end
                    if inside and p < min(end, m_end) and p + PAGE > start:
                        pages.add(p)
                break
    spans = []
    for p in sorted(pages):
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + PAGE)
        else:
            spans.append((p, p + PAGE))
    return spans


def test_page_spans_match_a_page_by_page_walk():
    rng = random.Random(0)
    for _ in range(300):
        mappings, at = [], rng.randrange(0, 8) * 4096
        for _ in range(rng.randrange(1, 4)):
            size = rng.randrange(1, 3000) * 4096
            mappings.append((at, at + size))
            at += size + rng.choice([0, 4096, PAGE])
        ranges = []
        for _ in range(rng.randrange(1, 6)):
            m_start, m_end = rng.choice(mappings)
            start = rng.randrange(m_start, m_end)
            ranges.append((start, start + rng.randrange(1, 6 * PAGE)))
        got = hugepages._page_spans(ranges, mappings)
        assert got == brute_spans(ranges, mappings), (ranges, mappings)


def test_env_is_validated(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "yes")
    with pytest.raises(ValueError, match="allowed values: 0, 1"):
        hugepages.enabled()
    monkeypatch.setenv(hugepages.ENV, "0")
    assert hugepages.collapse([torch.ones(4 << 20)]) == 0


def anon_huge_kb(lo: int, hi: int) -> int:
    """AnonHugePages summed over the mappings overlapping [lo, hi) (/proc/self/smaps). A
    madvise over part of a mapping splits it, so the collapsed pages may lie in several."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start < hi and lo < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux transparent huge pages")
def test_collapse_keeps_values_and_addresses():
    weight = torch.randn(6 << 20)  # 24 MiB: several whole 2 MiB pages
    want, address = weight.clone(), weight.data_ptr()
    done = hugepages.collapse([weight, weight[5:9]])  # a view of the same storage: once
    assert weight.data_ptr() == address and torch.equal(weight, want)
    if done == 0:
        pytest.skip("this kernel did not collapse (THP never, or no MADV_COLLAPSE)")
    # Whole pages inside are 22-24 MiB; the pages holding either end are collapsed with them.
    assert 16 << 20 <= done <= (24 << 20) + 2 * PAGE and done % PAGE == 0, done
    lo, hi = address // PAGE * PAGE, address + (24 << 20) + PAGE
    assert anon_huge_kb(lo, hi) >= done // 1024
