"""dflash2-train's arguments and environment (the bad-input probe's trainer class): every out-of-range value,
a malformed torchrun environment and a missing device are one line, exit 2, before anything is read or written:
no drafter/config.json or train_state/ left behind, the inputs byte-identical."""

from __future__ import annotations

import os

import pytest

from dflash2 import tiny
from dflash2.cli import train as train_cli
from tests.errorcheck import one_line_error, snapshot

CASES = [
    (["--steps", "0"], "--steps: expected >= 1, found 0"),
    (["--steps", "-5"], "--steps: expected >= 1, found -5"),
    (["--grad-accum", "0"], "--grad-accum: expected >= 1, found 0"),
    (["--threads", "0"], "--threads: expected >= 1, found 0"),
    (["--anchors", "0"], "--anchors: expected >= 1, found 0"),
    (["--seqs-per-step", "0"], "--seqs-per-step: expected >= 1, found 0"),
    (["--vocab-words", "-3"], "--vocab-words: expected >= 0, found -3"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens: expected >= 1, found 0"),
    (["--gen-batch", "0"], "--gen-batch: expected >= 1, found 0"),
    (["--shard-size", "0"], "--shard-size: expected >= 1, found 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected >= 1, found 0"),
    (["--layers", "0"], "--layers: expected >= 1, found 0"),
    (["--block-size", "1"], "--block-size: expected >= 2, found 1"),
    (["--top-k", "0"], "--top-k: expected >= 1, found 0"),
    (["--rank", "0"], "--rank: expected >= 1, found 0"),
    (["--draft-vocab", "0"], "--draft-vocab: expected >= 1, found 0"),
    (["--draft-vocab", "100000"], "--draft-vocab: expected <= the target's vocab_size"),
    (["--mask-token-id", "100000"], "--mask-token-id: expected < the target's vocab_size"),
    (["--taps", "1,99"], "--taps: expected layer ids < the target's"),
    (["--lr", "nan"], "--lr: expected a finite number > 0, found nan"),
    (["--lr", "-1"], "--lr: expected a finite number > 0, found -1.0"),
    (["--kd-weight", "-1"], "--kd-weight: expected a finite number >= 0, found -1.0"),
    (["--holdout", "1"], "--holdout: expected a share in (0, 1), found 1.0"),
    (["--holdout", "1.5"], "--holdout: expected a share in (0, 1), found 1.5"),
    (["--loss-decay", "0"], "--loss-decay: expected a finite number > 0, found 0.0"),
    (["--loss-decay", "nan"], "--loss-decay: expected a finite number > 0, found nan"),
    (["--max-shard-mb", "0"], "--max-shard-mb: expected a size in MB > 0, found 0.0"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N, found 'tpu'"),
    (["--prompts", "templated:0"], "--prompts 'templated:0': expected 'templated[:N]' with an integer N >= 1"),
    (["--init-weights", "{tmp}/nowhere"], "--init-weights {tmp}/nowhere: expected a drafter folder with config.json, "
                                          "found nothing there"),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.make_pair(tmp_path_factory.mktemp("train-errors"), family="llama", version=2)[1]


def _train(capsys, target, tmp_path, *extra, env=None, monkeypatch=None) -> str:
    before = snapshot(target, tmp_path)
    code = train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(tmp_path / "c"),
                           "--prompts", "templated:4", "--threads", "1",
                           *[x.format(tmp=tmp_path) for x in extra]])
    assert code == 2
    assert snapshot(target, tmp_path) == before  # nothing written, nothing changed
    return one_line_error(capsys.readouterr().err, "dflash2-train")


@pytest.mark.parametrize("extra,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_out_of_range_arguments_are_refused_before_anything_is_written(capsys, target, tmp_path, extra, message):
    assert message.format(tmp=tmp_path) in _train(capsys, target, tmp_path, *extra)


def test_cuda_without_cuda_is_named(capsys, target, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: --device cuda is valid here")
    assert "--device cuda: expected a CUDA device, found none" in _train(capsys, target, tmp_path, "--device", "cuda")


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "two"}, "environment WORLD_SIZE: expected an integer, found 'two'"),
    ({"WORLD_SIZE": "1", "RANK": "3"}, "environment RANK: expected 0..0 (WORLD_SIZE 1), found 3"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "environment MASTER_ADDR, MASTER_PORT: expected with WORLD_SIZE 2"),
    ({"WORLD_SIZE": "0"}, "environment WORLD_SIZE: expected >= 1, found 0"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "environment MASTER_PORT: expected a port 1..65535, found 'http'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
      "DFLASH2_RENDEZVOUS_TIMEOUT": "soon"}, "environment DFLASH2_RENDEZVOUS_TIMEOUT: expected seconds in (0, 1e7), found 'soon'"),
])
def test_a_malformed_torchrun_environment_is_named_not_waited_on(capsys, target, tmp_path, monkeypatch, env, message):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DFLASH2_RENDEZVOUS_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert message in _train(capsys, target, tmp_path)


def test_a_rank_that_never_comes_is_a_named_timeout_not_a_hang():
    """WORLD_SIZE=2 with one rank started: torch alone waits 30 min in silence; we wait
    DFLASH2_RENDEZVOUS_TIMEOUT seconds, say so first, then name what did not happen."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DFLASH2_RENDEZVOUS_TIMEOUT": "3"}
    code = ("from dflash2.errors import Dflash2Error\nfrom dflash2.train import distributed\n"
            "try:\n    distributed.join('cpu')\nexcept Dflash2Error as e:\n    print('error:', e)\n")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t < 90, "it waited far past its timeout"
    assert "rank 0: waiting up to 3 s for 2 ranks at 127.0.0.1:" in r.stderr, r.stderr
    assert f"error: rank 0: the 2 ranks did not meet at 127.0.0.1:{port} within 3 s" in r.stdout, (r.stdout, r.stderr)


def test_taps_that_are_not_numbers_say_so(capsys, target, tmp_path):
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--taps", "a,b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'a,b': expected layer ids separated by commas" in err and "<lambda>" not in err


def test_a_corpus_too_small_to_hold_one_out_is_named_before_the_drafter_is_written(capsys, target, tmp_path):
    """One record, held out for the curve, left nothing to train on: torch.cat's traceback after OUT/config.json
    was written. Now one line naming the corpus; the corpus (asked for) stays, OUT is never created."""
    code = train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(tmp_path / "c"),
                           "--prompts", "templated:1", "--max-new-tokens", "2", "--threads", "1"])
    assert code == 2
    err = capsys.readouterr().err  # (transformers' loading bar comes first: the corpus was generated)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"dflash2-train: error: {tmp_path / 'c'}: 1 record(s), all held out for evaluation (--holdout 0.1); "
        "expected at least 2"), err
    assert not (tmp_path / "d").exists() and (tmp_path / "c" / "corpus.json").is_file()
