"""Seqs written as ranges, for reports and log lines."""

from __future__ import annotations


def seq_ranges(seqs: list[int]) -> str:
    """``1..3, 7`` for sorted ``[1, 2, 3, 7]``."""
    spans: list[list[int]] = []
    for seq in seqs:
        if spans and spans[-1][1] == seq - 1:
            spans[-1][1] = seq
        else:
            spans.append([seq, seq])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
