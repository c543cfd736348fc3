"""What one document's attention costs by its length, as the kernel runs it (issue 37).

Packed documents attend document by document (models/documents.py: one causal SDPA call per
document and block), so a row's attention is the sum over its documents of the kernel's time at
each length. The FLOP count says that sum follows the squared lengths; the kernel does not:
torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) cuts queries into
blocks of 32, 64 or 256 rows (lengths below 192, below 768, from 768) and keys into blocks of 512,
skips only whole key blocks past the diagonal (a document up to 512 tokens computes its whole
square), and its backward runs a step slower from 512 keys on (one more token, 511 -> 512, took a
third longer on this host: bench/mixed_length.py's calibration). Fitted on the squares, a
calibration line averaged those regimes and missed rows of long documents against rows of many
short ones by 3-15% in the backward.

An AttentionCurve is that kernel timed (runtime/calibrate/attention_curve.py: the model's heads and
head width, one thread, each length's forward and backward) at every length up to 32 and, past it, at
each multiple of 16 and the length before it (`grid_lengths`); between grid points it is linear, past
the last it grows with the square. The kernel is a sawtooth of period 16 (timed on this host, heads 4
x width 8): the forward rises through each 16 tokens and drops at the multiple -- 496 -> 511 tokens
1.26 -> 1.51 ms, 512 tokens 1.33 ms; 1008 -> 1023 3.80 -> 4.12 ms, 1024 4.01 ms -- and the backward
steps up at each multiple of 512 (1023 -> 1024: 11.8 -> 12.7 ms; 1535 -> 1536: 24.1 -> 25.1 ms). A
coarser grid (powers and halves, round 7's) read lengths between its points through the teeth: up to
7.5% high on a backward between 896 and 1024 tokens.
A row's attention is `row_seconds` (one block's); the calibration line fits a coefficient on it
(it came out at the stage's block count, 1.98-2.01 for two blocks: bench/mixed_length.py), so a
level shift of the whole machine does not matter, only the curve's shape.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, Iterable, Sequence, Tuple

# every length up to SMALL (short documents, cheap to time), then both ends of each tooth
SMALL = 32
TOOTH = 16


def grid_lengths(budget: int) -> Tuple[int, ...]:
    """The lengths the kernel is timed at, up to `budget`: 1..SMALL, then each multiple of TOOTH and
    the length before it (both sides of every drop of the sawtooth and of the switches at 192, 512,
    768 and 1024), and the budget itself (a row's longest document)."""
    if budget < 1:
        raise ValueError("an attention curve needs a budget of at least one token")
    teeth = {n for k in range(SMALL // TOOTH + 1, budget // TOOTH + 1) for n in (TOOTH * k - 1, TOOTH * k)}
    return tuple(sorted(set(range(1, min(budget, SMALL) + 1)) | teeth | {budget}))


KINDS = ("F", "B")


@dataclass(frozen=True)
class AttentionCurve:
    """Seconds of one block's causal attention over one document of each grid length, forward ("F")
    and backward ("B"), as timed on this host."""
    lengths: Tuple[int, ...]
    forward_s: Tuple[float, ...]
    backward_s: Tuple[float, ...]

    def __post_init__(self):
        if not self.lengths or list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] < 1:
            raise ValueError("an AttentionCurve needs increasing lengths from 1 up")
        if not len(self.lengths) == len(self.forward_s) == len(self.backward_s):
            raise ValueError("an AttentionCurve needs one forward and one backward time per length")

    def seconds(self, length: int, kind: str) -> float:
        """One document of `length` tokens: linear between grid points, the square past the last."""
        times = self.forward_s if kind == "F" else self.backward_s
        if length <= 0:
            return 0.0
        last = self.lengths[-1]
        if length >= last:
            return times[-1] * (length / last) ** 2
        j = bisect.bisect_left(self.lengths, length)
        if self.lengths[j] == length or j == 0:
            return times[j]
        a, b = self.lengths[j - 1], self.lengths[j]
        w = (length - a) / (b - a)
        return times[j - 1] * (1.0 - w) + times[j] * w

    def row_seconds(self, lengths: Iterable[int], kind: str) -> float:
        """A row's attention (one block): the sum over its documents."""
        return sum(self.seconds(n, kind) for n in lengths)

    def rows(self, rows: Sequence[Sequence[int]]) -> Dict[str, list]:
        """{F, B}: each row's attention seconds (one block)."""
        return {kind: [self.row_seconds(r, kind) for r in rows] for kind in KINDS}

    def to_dict(self) -> Dict:
        return {"lengths": list(self.lengths), "forward_s": list(self.forward_s), "backward_s": list(self.backward_s)}

    @classmethod
    def from_dict(cls, d: Dict) -> "AttentionCurve":
        return cls(tuple(int(x) for x in d["lengths"]), tuple(float(x) for x in d["forward_s"]),
                   tuple(float(x) for x in d["backward_s"]))

