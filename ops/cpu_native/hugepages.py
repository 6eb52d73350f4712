"""Weights on 2 MiB pages (Linux transparent huge pages), in place, for the batch-1 CPU kernels.

Why: a decode step streams every weight byte once; on 4 KiB pages that is a TLB miss and a page
walk every 4 KiB, and the kernels' weight streams ran at 13.5-15.6 GB/s where the same bytes on 2
MiB pages ran at 19.7-20.2 GB/s (bf16; fp32 19.9 vs 23.3) on the 2-core Xeon box
(docs/performance-log.md, 2026-12-04). The tensors keep their addresses: the memory mappings
holding them are asked to be backed by huge pages (madvise MADV_HUGEPAGE) and collapsed now
(MADV_COLLAPSE, Linux 6.1+), so every view of a weight stays valid and nothing is copied. Only
whole 2 MiB-aligned pages inside one mapping can be collapsed; neighbouring heap memory in such a
page is collapsed with it (harmless). A kernel without MADV_COLLAPSE, THP set to `never`, or a
non-Linux OS: nothing changes (results are the same either way; only the speed differs).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
ENV = "TORCH_RUNNER_HUGE_PAGES"  # "1" (default) or "0"


def enabled() -> bool:
    """TORCH_RUNNER_HUGE_PAGES (default 1), validated; False off Linux."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r} is invalid; allowed values: 0, 1")
    return value == "1" and sys.platform.startswith("linux")


def _mappings() -> list[tuple[int, int]]:
    """This process's writable private anonymous-or-heap mappings, [start, end) addresses, with
    adjacent ones merged (madvise splits a mapping where its flags change; one weight may then
    lie across two, and a later MADV_HUGEPAGE over both merges them again)."""
    spans: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            perms = fields[1]
            path = fields[5] if len(fields) > 5 else ""
            if "w" in perms and "p" in perms and path in ("", "[heap]"):
                start, end = (int(v, 16) for v in fields[0].split("-"))
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((start, end))
    return spans


def _page_spans(ranges: Iterable[tuple[int, int]], mappings) -> list[tuple[int, int]]:
    """The 2 MiB-aligned spans covering `ranges` (each widened to page bounds), clipped to the
    mapping that holds it and merged; pure arithmetic (tests/test_ops_cpu_native_hugepages.py)."""
    spans = []
    for start, end in ranges:
        for m_start, m_end in mappings:
            if m_start <= start < m_end:
                lo = max(start // PAGE * PAGE, -(-m_start // PAGE) * PAGE)
                hi = min(-(-min(end, m_end) // PAGE) * PAGE, m_end // PAGE * PAGE)
                if hi > lo:
                    spans.append((lo, hi))
                break
    spans.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Back the CPU tensors' memory with huge pages; returns the bytes collapsed (0 when the
    kernel cannot or TORCH_RUNNER_HUGE_PAGES=0)."""
    if not enabled():
        return 0
    ranges = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.numel():
            continue
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # opaque (oneDNN-packed): no storage
            continue
        ranges[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
    if not ranges:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        spans = _page_spans(ranges.items(), _mappings())
    except OSError as exc:
        logger.info("huge pages: not available here (%s)", exc)
        return 0
    done, failed = 0, {}
    for lo, hi in spans:
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
        for page in range(lo, hi, PAGE):  # one page a call: a page that fails leaves the rest
            if libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(PAGE), MADV_COLLAPSE) == 0:
                done += PAGE
            else:
                err = os.strerror(ctypes.get_errno())
                failed[err] = failed.get(err, 0) + 1
    if failed:
        logger.info("huge pages: %s 2 MiB pages stay small (%s)", sum(failed.values()),
                    ", ".join(f"{n}: {e}" for e, n in failed.items()))  # fmt: skip
    return done
