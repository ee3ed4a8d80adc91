"""Draft-path policies for measurement: what the drafter's lattice could have drafted.

- selector: the DFlash2 selector's walked path (what the runtime drafts)
- top1:     the top-1 candidate per position (what DFlash v1 drafts from the same drafter)
- oracle:   the best path inside the top-K lattice given the target's own greedy continuation
            (a ceiling, not deployable: it reads the answer)
The verify step is unchanged, so every policy stays lossless.
"""

from __future__ import annotations

from typing import Sequence

from dflash2.runtime.session import SpecSession
from dflash2.speculative import Drafted

POLICIES = ("selector", "top1", "oracle")


class PolicySession(SpecSession):
    """A session whose drafts come from a policy over the drafter's candidate lattice."""

    def __init__(self, *args, policy: str = "selector", **kw):
        super().__init__(*args, **kw)
        if policy not in POLICIES:
            raise ValueError(f"policy expected one of {POLICIES}, found {policy!r}")
        if policy != "selector" and not self.has_lattice:
            raise ValueError(f"policy {policy!r} needs a DFlash2 drafter (a candidate lattice); this is DFlash v1")
        self.policy, self.truth, self.prompt_len = policy, None, 0

    def set_truth(self, prompt_len: int, greedy_ids: Sequence[int]) -> None:
        """The target-only greedy continuation of this prompt (for the oracle)."""
        self.prompt_len, self.truth = prompt_len, list(greedy_ids)

    def draft(self, anchor: int, uniforms: Sequence[float] | None = None, temperature: float = 0.0) -> Drafted:
        d = super().draft(anchor, uniforms, temperature)
        if self.policy == "selector":
            return d
        if d.q is not None:
            raise ValueError(f"policy {self.policy!r} measures greedy acceptance only; at temperature > 0 "
                             f"the drafts must be the sampled walk (policy 'selector')")
        cand = self.cand_ids.pull(self.cand_ids.capacity)  # [S, K]; only measurement reads the lattice
        if self.policy == "top1":
            return Drafted(cand[:, 0], d.confidence)
        start = self.pos - self.prompt_len + 1  # index in truth of the token after the anchor
        out = cand[:, 0].copy()
        for k in range(len(out)):
            want = self.truth[start + k] if start + k < len(self.truth) else -1
            if want not in cand[k]:
                break
            out[k] = want
        return Drafted(out, d.confidence)
