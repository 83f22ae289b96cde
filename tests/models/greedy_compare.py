"""Two greedy runs of the same model that may differ only by rounding (bf16 kernels, graphs
against eager, bf16 against float32), compared where they are comparable: at every position
both runs reached with identical tokens (teacher-forced by construction), the log-probabilities
of the top tokens both list; where the tokens part, the gap between them must be a near tie.
A real bug (a stale input, a wrong position, a dropped key) moves logprobs by far more than
rounding does, at positions where the two runs still agree on every earlier token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.runtime.types import RequestOutput, TokenLogprob


@dataclass
class GreedyComparison:
    positions: int = 0  # positions compared (identical tokens before them)
    total: int = 0  # positions of the runs
    entries: int = 0  # top-token logprobs compared
    sum_abs: float = 0.0
    max_abs: float = 0.0  # largest |logprob difference| of a token both runs list
    # (request index, position, margin): where the tokens part, how much better each run found
    # its own token than the other's (the larger of the two; inf: not in the other's top list)
    divergences: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / max(self.entries, 1)

    @property
    def worst_margin(self) -> float:
        return max((m for _, _, m in self.divergences), default=0.0)

    def __str__(self) -> str:
        return (
            f"{self.positions}/{self.total} positions, mean |dlp| {self.mean_abs:.2e}, "
            f"max {self.max_abs:.2e}, {len(self.divergences)} divergences "
            f"(worst margin {self.worst_margin:.2e})"
        )


def _margin(own: TokenLogprob, other_token: int) -> float:
    top = dict(own.top)
    if other_token not in top:
        return float("inf")
    return own.logprob - top[other_token]


def compare_greedy(ref: list[RequestOutput], other: list[RequestOutput]) -> GreedyComparison:
    """Both runs' outputs in prompt order, generated with `logprobs=True, top_logprobs=k`."""
    out = GreedyComparison()
    for r, (a, b) in enumerate(zip(ref, other, strict=True)):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None, "generate with logprobs=True"
        out.total += len(la)
        for i, (x, y) in enumerate(zip(la, lb, strict=True)):
            out.positions += 1
            tops = dict(y.top)
            for token, lp in x.top:
                if token in tops:
                    d = abs(lp - tops[token])
                    out.entries += 1
                    out.sum_abs += d
                    out.max_abs = max(out.max_abs, d)
            if x.token_id != y.token_id:
                margin = max(_margin(x, y.token_id), _margin(y, x.token_id))
                out.divergences.append((r, i, margin))
                break  # later positions have different inputs
    return out


def check_within(cmp: GreedyComparison, base: GreedyComparison, factor: float = 3.0) -> None:
    """`cmp` within `factor` times the rounding noise `base` shows (e.g. bf16 against float32
    through the reference kernels): mean and max logprob differences, every divergence a near
    tie, and at least half of the positions compared (so the check is never vacuous)."""
    bound = factor * base.max_abs
    assert cmp.positions >= cmp.total / 2, f"too few positions compared: {cmp} (base {base})"
    assert cmp.mean_abs <= factor * base.mean_abs, f"{cmp} against the noise of {base}"
    assert cmp.max_abs <= bound, f"{cmp} against the noise of {base}"
    assert cmp.worst_margin <= bound, f"a divergence that is no near tie: {cmp} (base {base})"
