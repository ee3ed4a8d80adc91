"""What the Qwen3.5 target graph computes (dflash2.export.qwen3_5), as a torch module around the reference
(dflash2.reference.qwen3_5.Qwen35Target; Qwen3.5-MoE's Qwen35MoeTarget is a subclass with the experts' block as its
layers' MLP, served as it is), and its GraphSpec: the validation feeds the export checks the graph on.

(input_ids [n], past_kv [P, La, 2, kv, hd], per GDN layer j: conv_state.{j} [1, C, K-1], rec_state.{j} [1, Hv, dk, dv])
  -> next_ids [n], context [n, C'], new_kv [n, La, 2, kv, hd], logits [min(n, B), V],
     per GDN layer j: conv_states.{j} [W', C, K-1], rec_states.{j} [W', Hv, dk, dv], the states after each of the
     last W' = min(n, B) rows (signature.state_names orders them: layer-major, conv before rec).
The reference keeps the states stacked over layers (State.conv [Lg, C, K-1], State.rec [Lg, Hv, dk, dv]): the
module splits and stacks at its edges. The feeds cover a prefill longer than the window (the graph's no-state
head), a verify of B rows after it (every row's state kept), and a 1-row decode from a state committed mid-verify
(what rollback hands the next step).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2.export import signature as N
from dflash2.reference.qwen3_5 import Qwen35Target, State, commit


class HybridTargetGraph(nn.Module):
    def __init__(self, target: Qwen35Target, drafter, fuse_context: bool = True):
        super().__init__()
        self.target, self.drafter, self.fuse = target, drafter, fuse_context
        self.block_size = drafter.config.block_size

    def forward(self, input_ids, past_kv, *states):
        """states: conv_state.{j}, rec_state.{j} per GDN layer (then past_len [1] for the TensorRT flavour)."""
        past_len = states[-1] if len(states) % 2 else None
        if past_len is not None:  # the TensorRT flavour: the whole buffer, rows >= past_len stale
            past_kv = past_kv[: int(past_len.reshape(-1)[0])]
        logits, taps, step = self.target(input_ids.long(), _state(past_kv, states[:len(states) // 2 * 2]))
        logits = logits.float()
        context = self.drafter.context(taps) if self.fuse else taps
        W = min(input_ids.shape[0], self.block_size)
        conv, rec = step.conv[-W:], step.rec[-W:]  # [W', Lg, ...]
        per_layer = [t[:, j] for j in range(conv.shape[1]) for t in (conv, rec)]
        return (logits.argmax(-1).to(torch.int32), context, step.kv, logits[-self.block_size:], *per_layer)

    def target_logits(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, V] fp32 logits of every row of a validation feed (the deviation measurement reads them)."""
        past = N.state_names(len(self.target.config.linear_layers))[0]
        state = _state(feed[N.PAST_KV], [feed[n] for n in past])
        return self.target(feed[N.INPUT_IDS].long(), state)[0].float()


def _state(kv: torch.Tensor, states) -> State:
    """The reference's State from the graph's per-layer state inputs (conv_state.{j}, rec_state.{j}, ...)."""
    return State(kv, torch.cat(list(states[0::2])), torch.cat(list(states[1::2])))


def target_spec(target: Qwen35Target, drafter, fuse_context: bool, gen):
    """The hybrid target's GraphSpec (dflash2.export.graphs.GraphSpec), portable flavour."""
    from dflash2.export.graphs import GraphSpec

    module = HybridTargetGraph(target, drafter, fuse_context)
    B, V = drafter.config.block_size, target.config.vocab_size

    def feeds():
        g = gen(0)
        prompt = torch.randint(0, V, (B + 3,), generator=g, dtype=torch.int32)  # longer than the window
        verify = torch.randint(0, V, (B,), generator=g, dtype=torch.int32)
        empty = target.empty_state()
        with torch.no_grad():
            _, _, step = target(prompt.long(), empty)
            s1 = commit(empty, step, len(prompt))
            _, _, vstep = target(verify.long(), s1)
            s2 = commit(s1, vstep, B // 2)  # a rollback: half the verify accepted
        return [_feed(prompt, empty), _feed(verify, s1), _feed(verify[B // 2:B // 2 + 1], s2)]

    example = tuple(_feed(torch.arange(5), target.empty_state()).values())
    past, present = N.state_names(len(target.config.linear_layers))
    inputs = [N.INPUT_IDS, N.PAST_KV, *past]
    outputs = [N.NEXT_IDS, N.CONTEXT, N.NEW_KV, N.LOGITS, *present]
    return GraphSpec("target", module, inputs, outputs,
                     {N.INPUT_IDS: {0: "n"}, N.PAST_KV: {0: "past"}, **{n: {} for n in past}}, example, feeds)


def _feed(ids: torch.Tensor, s: State) -> dict[str, torch.Tensor]:
    past = N.state_names(s.conv.shape[0])[0]
    per_layer = [t[j][None] for j in range(s.conv.shape[0]) for t in (s.conv, s.rec)]  # [1, C, K-1], [1, Hv, dk, dv]
    return {N.INPUT_IDS: ids.to(torch.int32), N.PAST_KV: s.kv, **dict(zip(past, per_layer))}
