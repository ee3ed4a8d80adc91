"""A hybrid target's recurrent state: its manifest record (StateSignature), the export's signature helper, the
runtime's ping-pong binding (RowStates), and a session over a toy target graph whose state is checkable."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import onnx
import pytest

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import signature as sg
from dflash2.manifest.jsonio import _convert, _plain
from dflash2.runtime.ort import OrtBackend
from dflash2.runtime.session import SpecSession, buffer_bytes
from dflash2.runtime.state import INITIAL, RowStates, state_bytes
from dflash2.speculative import Drafted, generate
from tests.exports import edit_manifest
from tests.hybrid_toy import (B, C, DK, DV, HV, K1, LG, PAST, PRESENT, ROWS, V, ZERO, drafter_graph, facts, graph_io,
                              io_of, names, reference, state_rows, state_sig, target_graph)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(folder, target signature, drafter signature) of the toy pair."""
    folder = tmp_path_factory.mktemp("toy_hybrid")
    t, d = target_graph(), drafter_graph()
    onnx.checker.check_model(t, full_check=True)
    onnx.save(t, folder / "target.onnx")
    onnx.save(d, folder / "drafter.onnx")
    tio, dio = io_of(t), io_of(d)
    ts = sg.signature("target", "prefix", *names(tio), state_window=B, io=tio)
    ds = sg.signature("drafter", "prefix", *names(dio))
    return folder, ts, ds


def session(toy, cls=SpecSession, **kw) -> SpecSession:
    folder, ts, ds = toy
    backend = OrtBackend(folder, {"target": "target.onnx", "drafter": "drafter.onnx"},
                         {"target": ts, "drafter": ds}, threads=1)
    return cls(facts(), backend, **kw)


# --- (a) the manifest record and the export's helper ---------------------------------------------------------

def test_the_toy_signature_records_the_state(toy):
    _, ts, ds = toy
    assert ts.state == state_sig() and ds.state is None
    assert PAST == ["conv_state.0", "rec_state.0", "conv_state.1", "rec_state.1"]  # per GDN layer, conv first
    assert set(PAST) <= ts.names()[0] and set(PRESENT) <= ts.names()[1]
    assert ts.problems("graphs.target.signature", graph_io(target_graph()), "target") == []


def test_a_signature_without_state_is_unchanged():
    """A dense graph's signature and its JSON are what they were before the state binding existed."""
    ins, outs = ["input_ids", "past_kv"], ["next_ids", "context", "logits", "new_kv"]
    s = sg.signature("target", "prefix", ins, outs)
    assert s.state is None and "state" not in _plain(s)
    assert _plain(s) == {"inputs": {"ids": "input_ids"}, "outputs": {"next_ids": "next_ids", "context": "context",
                         "logits": "logits"}, "kv": {"kind": "prefix", "past": ["past_kv"], "present": ["new_kv"]},
                         "capabilities": ["logits"]}


def test_the_signature_helper_refuses_a_partial_state():
    io = io_of(target_graph())
    ins, outs = names(io)
    with pytest.raises(ValueError, match=r"recurrent state needs .* found state tensors " +
                       re.escape(f"{PAST + PRESENT}, state_window None")):
        sg.signature("target", "prefix", ins, outs)
    with pytest.raises(ValueError, match=re.escape(f"found state tensors {PAST + PRESENT[:-1]}")):
        sg.signature("target", "prefix", ins, [o for o in outs if o != "rec_states.1"], state_window=B, io=io)
    with pytest.raises(ValueError, match=re.escape(f"found state tensors {PAST[1:] + PRESENT}")):
        sg.signature("target", "prefix", [i for i in ins if i != "conv_state.0"], outs, state_window=B, io=io)
    dense_in, dense_out = ins[:2], outs[:4]
    with pytest.raises(ValueError, match=r"found state tensors \[\], state_window 4"):
        sg.signature("target", "prefix", dense_in, dense_out, state_window=B, io=io)
    with pytest.raises(ValueError, match=r"tensors \['conv_state.0'\] unnamed by the contract"):
        sg.signature("drafter", "prefix", ["context", "anchor", "past_ctx_kv", "conv_state.0"],
                     ["draft_ids", "confidence", "new_ctx_kv"])
    io["outputs"][-1]["shape"] = ["w", HV, DK, DV + 1]
    with pytest.raises(ValueError, match=r"rec_states.1 expected shape \[W', 2, 2, 3\], found "
                                         r"\['w', 2, 2, 4\]"):
        sg.signature("target", "prefix", ins, outs, state_window=B, io=io)


def test_json_round_trip():
    sig = sg.signature("target", "prefix", *names(io_of(target_graph())), state_window=B, io=io_of(target_graph()))
    problems: list[str] = []
    back = _convert(mf.Signature, json.loads(json.dumps(_plain(sig))), "sig", problems)
    assert problems == [] and back == sig and isinstance(back.state, mf.StateSignature)
    assert _plain(sig)["state"] == {"kind": "rows", "past": PAST, "present": PRESENT, "rows": ROWS,
                                    "dtypes": ["float32"] * 4, "window": B}


@pytest.mark.parametrize("change, want", [
    (dict(kind="cols"), "S.state.kind: expected one of ['rows'], found 'cols'"),
    (dict(past=[]), "S.state.past: expected at least 1 state tensor, found none"),
    (dict(past=PAST[:1]), "S.state.present: expected 1 entries (one per state.past tensor), found 4"),
    (dict(present=PRESENT + ["x"]), "S.state.present: expected 4 entries (one per state.past tensor), found 5"),
    (dict(rows=ROWS[:1]), "S.state.rows: expected 4 entries (one per state.past tensor), found 1"),
    (dict(dtypes=["float32"]), "S.state.dtypes: expected 4 entries"),
    (dict(window=0), "S.state.window: expected >= 1, found 0"),
    (dict(rows=[[C, 0], *ROWS[1:]]), "S.state.rows[0]: expected a shape of positive ints, found [3, 0]"),
    (dict(rows=[[], *ROWS[1:]]), "S.state.rows[0]: expected a shape of positive ints, found []"),
    (dict(dtypes=["float32", "float8", "float32", "float32"]), "S.state.dtypes[1]: expected one of ['float32', "),
    (dict(present=["conv_state.0", *PRESENT[1:]]), "S.state: expected distinct tensor names"),
    (dict(past=["conv_state.0", "recurrent", *PAST[2:]]), "S.state: recurrent is not an input of the graph"),
    (dict(present=[PRESENT[0], "next_ids_x", *PRESENT[2:]]), "S.state: next_ids_x is not an output of the graph"),
    (dict(rows=[[C, K1 + 1], *ROWS[1:]]), "S.state: conv_state.0 expected shape [1, 3, 4], found [1, 3, 3]"),
    (dict(dtypes=["float16"] + ["float32"] * 3),
     "S.state: conv_state.0 expected element type float16, found float32"),
])
def test_problems_name_each_broken_field(toy, change, want):
    _, ts, _ = toy
    broken = dataclasses.replace(ts, state=dataclasses.replace(ts.state, **change))
    problems = broken.problems("S", graph_io(target_graph()), "target")
    assert any(p.startswith(want) for p in problems), problems


def test_problems_check_the_past_leading_dim_and_the_graph(toy):
    _, ts, ds = toy
    io = graph_io(target_graph())
    io.inputs[2] = mf.IoSpec("conv_state.0", "float32", [2, *ROWS[0]])
    assert ts.problems("S", io, "target") == ["S.state: conv_state.0 expected shape [1, 3, 3], found [2, 3, 3]"]
    on_drafter = dataclasses.replace(ds, state=state_sig())
    assert "S.state: expected none (only a target graph keeps a recurrent state), found a 'rows' binding" in \
        on_drafter.problems("S", None, "drafter")


@pytest.fixture
def stateful_export(export_dir, tmp_path):
    """A real export whose target manifest entry is given the toy state tensors and binding, resealed: what a
    hybrid export's manifest holds, read back by the one reader."""
    out = tmp_path / "export"
    shutil.copytree(export_dir, out)
    B_ = mf.load(out).block_size

    def edit(data):
        g = data["graphs"]["target"]
        g["inputs"] += [{"name": n, "dtype": "float32", "shape": [1, *r]}
                        for n, r in zip(PAST, ROWS)]
        g["outputs"] += [{"name": n, "dtype": "float32", "shape": ["w", *r]}
                         for n, r in zip(PRESENT, ROWS)]
        g["signature"]["state"] = _plain(state_sig(window=B_))
    edit_manifest(out, edit)
    return out


def test_manifest_round_trip_with_a_state(export_dir, stateful_export):
    m = mf.load(stateful_export)
    assert m.signature("target").state == state_sig(window=m.block_size)
    assert mf.load(export_dir).signature("target").state is None  # manifests without it load as before
    assert "state" not in json.loads((export_dir / mf.NAME).read_text())["graphs"]["target"]["signature"]
    (stateful_export / mf.NAME).unlink()
    mf.write(stateful_export, m)
    assert mf.load(stateful_export) == m
    # the state rows count in what dflash2-run says it allocates
    T = m.max_seq_len
    assert buffer_bytes(m, T) - buffer_bytes(mf.load(export_dir), T) == state_bytes(m.signature("target").state) \
        == (2 * m.block_size + 1) * 4 * LG * (C * K1 + HV * DK * DV)


@pytest.mark.parametrize("edit, want", [
    (lambda s, B_: s.update(window=B_ - 1), "target signature state.window: expected >= block_size = {B} (the "
                                            "graphs' target keeps the states of a step's last window rows), found {W}"),
    (lambda s, B_: s.update(window="4"), 'graphs.target.signature.state.window: expected an integer, found a string'),
    (lambda s, B_: s.update(rows=[[2, 3, 3], [2, "x"]]),
     "graphs.target.signature.state.rows[1][1]: expected an integer"),
    (lambda s, B_: s.pop("dtypes"), "graphs.target.signature.state.dtypes: expected a list of a string, found nothing"),
    (lambda s, B_: s.update(kind="cols"), "graphs.target.signature.state.kind: expected one of ['rows'], found 'cols'"),
])
def test_the_reader_refuses_a_broken_state(stateful_export, edit, want):
    B_ = mf.load(stateful_export).block_size
    edit_manifest(stateful_export, lambda d: edit(d["graphs"]["target"]["signature"]["state"], B_))
    with pytest.raises(mf.ManifestError) as e:
        mf.load(stateful_export)
    want = want.format(B=B_, W=B_ - 1)
    assert any(p.startswith(want) for p in e.value.problems), e.value.problems


# --- (b) RowStates over the ONNX Runtime backend's buffers --------------------------------------------------

def row_states(window: int = B) -> RowStates:
    return RowStates(state_sig(window), OrtBackend(None, {}, {}))


def where(states: RowStates, view, i: int) -> tuple[int, int]:
    """(buffer, row) a view of state tensor i points at, found by address: what the graph will read."""
    for k, bufs in enumerate(states.buffers):
        b = bufs[i]
        if b.ptr <= view.ptr < b.ptr + b.nbytes:
            return k, (view.ptr - b.ptr) // b.row_bytes
    raise AssertionError("a view outside the state buffers")


def check_step(states: RowStates, n: int) -> int:
    """One step's views: inputs are 1-row views of current, outputs rows [0, W') of the other buffer. Returns it."""
    ins, outs = states.step(n)
    assert list(ins) == PAST and list(outs) == PRESENT
    k_in, r_in = states.current
    for i, (name, v) in enumerate(ins.items()):
        assert v.shape == (1, *ROWS[i]) and where(states, v, i) == (k_in, r_in)
        assert v.ptr == states.buffers[k_in][i].ptr + r_in * states.buffers[k_in][i].row_bytes
    written = {where(states, v, i)[0] for i, v in enumerate(outs.values())}
    (k_out,) = written
    assert k_out in (0, 1) and k_out != k_in  # never the buffer the step reads: no aliasing
    for i, v in enumerate(outs.values()):
        assert v.shape == (min(n, states.window), *ROWS[i]) and v.ptr == states.buffers[k_out][i].ptr
    return k_out


def test_first_step_reads_the_zero_initial_state():
    s = row_states()
    assert s.current == (INITIAL, 0)
    assert check_step(s, 3) == 0  # A
    for b in s.buffers[INITIAL]:
        assert b.shape[0] == 1 and not b.host.any()


@pytest.mark.parametrize("n", range(1, B + 1))
def test_commit_every_accepted_count(n):
    """A verify of n <= W rows accepted at a: the next step reads row a - 1 of the written buffer, writes the other."""
    for a in range(1, n + 1):
        s = row_states()
        s.step(2)
        s.commit(2, 2)  # current = A row 1
        assert s.current == (0, 1)
        k = check_step(s, n)
        assert k == 1
        s.commit(a, n)
        assert s.current == (1, a - 1)
        assert check_step(s, 1) == 0  # ping: back to A
        s.commit(1, 1)
        assert s.current == (0, 0)
        assert check_step(s, 1) == 1  # pong


def test_commit_zero_keeps_the_state():
    s = row_states()
    s.step(5)
    s.commit(5, 5)
    before = s.current
    k = check_step(s, 3)
    s.commit(0, 3)
    assert s.current == before
    assert check_step(s, 2) == k  # the discarded step's buffer is written again


def test_prefill_longer_than_the_window_keeps_its_last_row():
    s = row_states()
    assert check_step(s, 9) == 0
    s.commit(9, 9)  # the graph wrote the states after rows 5..8 into A rows 0..3
    assert s.current == (0, B - 1)


def test_a_commit_outside_the_window_is_refused():
    s = row_states()
    s.step(9)
    with pytest.raises(Dflash2Error, match=r"recurrent state commit of 2 rows: expected an accepted row whose state "
                                           r"the target graph kept, found row 1 of a 9-row step, where the graph keeps "
                                           r"the states of rows \[5, 9\) \(window 4\)"):
        s.commit(2, 9)
    with pytest.raises(Dflash2Error, match="found row 9 of a 9-row step"):
        s.commit(10, 9)
    with pytest.raises(Dflash2Error, match="found a commit of a 3-row step after a 9-row one"):
        s.commit(1, 3)
    s.commit(9, 9)
    with pytest.raises(Dflash2Error, match="found no target step since the last commit"):
        s.commit(1, 1)


def test_reset_and_buffers():
    s = row_states()
    for bufs in s.buffers[:2]:
        for b in bufs:
            b.host[...] = 7  # what earlier steps wrote
    s.step(4)
    s.commit(3, 4)
    s.reset()
    assert s.current == (INITIAL, 0) and check_step(s, 1) == 0
    assert not any(b.host.any() for b in s.buffers[INITIAL])
    assert sum(b.nbytes for b in s.named_buffers().values()) == state_bytes(state_sig())
    assert len(s.named_buffers()) == 3 * len(PAST)


def check_in_place(states: RowStates) -> tuple[int, int]:
    """A decode's views: the current row, in and out. Returns it."""
    cur = states.current
    ins, outs = states.step(1, in_place=True)
    assert list(outs) == PRESENT
    for i, (vi, vo) in enumerate(zip(ins.values(), outs.values())):
        assert where(states, vi, i) == where(states, vo, i) == cur and vi.ptr == vo.ptr and vo.shape == (1, *ROWS[i])
    return cur


@pytest.mark.parametrize("n", range(1, B + 1))
def test_a_decode_writes_over_the_row_it_reads_and_rollback_still_reaches_every_row(n):
    """After a commit of a of n verified rows, decodes write over the accepted row (nothing older is read again);
    the next verify writes the other buffer, so each of its rows can still be committed."""
    for a in range(1, n + 1):
        s = row_states()
        s.step(2)
        s.commit(2, 2)  # A row 1
        assert check_step(s, n) == 1
        s.commit(a, n)
        for _ in range(3):
            assert check_in_place(s) == (1, a - 1)
            s.commit(1, 1)
            assert s.current == (1, a - 1)  # the row stays: its contents moved on
        assert check_step(s, n) == 0  # a verify after decodes: the other buffer, any row committable
        s.commit(a, n)
        assert s.current == (0, a - 1)


def test_a_decode_from_the_zero_state_writes_a_not_the_initial_row():
    s = row_states()
    ins, outs = s.step(1, in_place=True)
    assert all(where(s, v, i) == (0, 0) for i, v in enumerate(outs.values()))
    assert all(where(s, v, i) == (INITIAL, 0) for i, v in enumerate(ins.values()))
    s.commit(1, 1)
    assert s.current == (0, 0) and check_in_place(s) == (0, 0)


def test_a_decode_written_in_place_cannot_be_discarded():
    s = row_states()
    s.step(3)
    s.commit(2, 3)
    s.step(1)  # not in place: may be discarded
    s.commit(0, 1)
    check_in_place(s)
    with pytest.raises(Dflash2Error, match=r"recurrent state commit of 0 rows: expected a step that can be "
                                           r"discarded, found a 1-row step written in place"):
        s.commit(0, 1)
    s.commit(1, 1)
    assert s.current == (0, 1)


# --- (c) a session over the toy hybrid target ---------------------------------------------------------------

PROMPT = [3, 17, 4, 40, 22, 9, 11]  # longer than the window: prefill keeps the state after its last row


def current_state(s: SpecSession) -> list[np.ndarray]:
    k, r = s.states.current
    return [s.states.buffers[k][i].host[r] for i in range(len(PAST))]


def assert_state(s: SpecSession, want) -> None:
    for got, row in zip(current_state(s), state_rows(want), strict=True):  # every layer's conv and rec rows
        np.testing.assert_array_equal(got, row)


def test_decode_after_a_verify_sees_the_state_of_the_accepted_rows(toy):
    s = session(toy)
    nxt, after = reference(ZERO, PROMPT)
    assert s.prefill(PROMPT).ids.tolist() == nxt
    assert_state(s, after[-1])
    base, checked = after[-1], 0
    for k in range(1, B + 1):
        tokens = [nxt[-1], 8, 30, 1][:k]
        want_v, want_after = reference(base, tokens)
        for a in range(1, k + 1):
            s.prefill(PROMPT)
            assert s.verify(tokens).ids.tolist() == want_v
            s.commit(a)
            state = want_after[a - 1]
            assert_state(s, state)
            at = s.states.current
            for tok in (13, 2):  # two decode steps, each writing over the row it reads
                (want_d,), (state,) = reference(state, [tok])
                assert s.decode(tok).ids.tolist() == [want_d]
                assert_state(s, state)
                assert s.states.current == at
            checked += 1
    assert checked == B * (B + 1) // 2


def test_the_check_sees_a_binding_without_rollback(toy):
    """The same check against a binding that keeps the state after the verify's last row (no rollback):
    the decode after a partial acceptance differs, so the test above can fail."""
    s = session(toy)
    nxt, after = reference(ZERO, PROMPT)
    s.prefill(PROMPT)
    tokens = [nxt[-1], 8, 30, 1]
    s.verify(tokens)
    s.states.commit(len(tokens), len(tokens))  # the last row's state, whatever was accepted
    s.pos += 1
    s.pending += 1
    _, want_after = reference(after[-1], tokens)
    want_d, _ = reference(want_after[0], [13])
    assert s.decode(13).ids.tolist() != want_d


class PlannedDrafts(SpecSession):
    """Drafts = the target's own greedy continuation with planned mistakes: every acceptance count happens."""

    def __init__(self, *args, truth, plan, **kw):
        super().__init__(*args, **kw)
        self.truth, self.plan, self.r = truth, plan, 0

    def draft(self, anchor, uniforms=None, temperature=0.0):
        d = super().draft(anchor)  # the toy drafter graph runs (its context KV is bound as for a real one)
        S, start = self.block_size - 1, self.pos - len(PROMPT) + 1
        good = self.plan[self.r % len(self.plan)]
        self.r += 1
        nxt = (self.truth[start: start + S] + [0] * S)[:S]
        return Drafted([t if i < good else (t + 1) % V for i, t in enumerate(nxt)], d.confidence)


def test_speculative_generation_equals_target_only(toy):
    truth, state = [], ZERO
    ids = list(PROMPT)
    nxt, after = reference(state, ids)
    token, state = nxt[-1], after[-1]
    for _ in range(40):  # the toy target's greedy continuation, one row at a time
        truth.append(token)
        (token,), (state,) = reference(state, [token])
    base = session(toy)
    assert generate(base, PROMPT, 40, speculative=False).ids == truth
    s = session(toy, PlannedDrafts, truth=truth, plan=[0, 3, 1, 2, 3, 0, 2])
    g = generate(s, PROMPT, 40, draft_len=B - 1)
    assert g.ids == truth and {0, 1, 2, 3} <= set(g.stats.accepted)


def test_the_session_counts_binds_and_keeps_its_state_buffers(toy):
    s = session(toy)
    assert s.buffer_bytes == buffer_bytes(facts(), 64) + state_bytes(toy[1].state)
    assert buffer_bytes(facts(), 64, toy[1]) == s.buffer_bytes
    lines = []
    session(toy, log=lines.append)
    assert lines == [f"allocating {s.buffer_bytes / 2**20:.1f} MiB of KV, context and recurrent-state buffers "
                     f"(max_seq_len 64)"]
    addresses = s.buffers()
    assert sum(k.startswith("states.") for k in addresses) == 3 * len(PAST)
    generate(s, PROMPT, 30, speculative=True, draft_len=B - 1)
    assert s.buffers() == addresses


def test_a_window_below_the_block_size_is_refused(toy):
    folder, ts, ds = toy
    narrow = dataclasses.replace(ts, state=state_sig(window=B - 1))
    backend = OrtBackend(folder, {"target": "target.onnx", "drafter": "drafter.onnx"},
                         {"target": narrow, "drafter": ds}, threads=1)
    with pytest.raises(Dflash2Error, match="target signature: state.window expected >= block_size 4 .* found 3"):
        SpecSession(facts(), backend)
