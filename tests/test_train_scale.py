"""The trainer at scale, shown small: DDP over 2 gloo processes == 1 process with the same global
batch; a run killed mid-way resumes to the same weights as an uninterrupted one; the corpus is
memory-mapped shards; the drafter can be written as size-capped shards."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dflash2 import tiny
from dflash2.train import state
from dflash2.train.corpus import Corpus, Record
from dflash2.train.data import generate_corpus, make_prompts


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    target = tiny.make_target(root / "target", family="llama")
    generate_corpus(target, make_prompts(20), root / "corpus", [1, 2], max_new_tokens=24, batch_size=8,
                    shard_size=6, log=lambda m: None)
    return target, root / "corpus"


def _cmd(target, corpus, out, steps, extra=()):
    return ["-m", "dflash2.cli.train", "--target", str(target), "--out", str(out), "--corpus", str(corpus),
            "--taps", "1,2", "--layers", "1", "--block-size", "6", "--top-k", "4", "--rank", "8", "--steps", str(steps),
            "--lr", "3e-3", "--seqs-per-step", "4", "--anchors", "5", "--mask-token-id", "3", "--threads", "1",
            "--eval-every", "1000", *extra]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _params(out):
    t = load_file(str(state.path(out)))
    return {k: v for k, v in t.items() if k.startswith("param/")}


def test_corpus_shards_are_memory_mapped_records(tiny_corpus):
    _, folder = tiny_corpus
    c = Corpus(folder)
    assert len(c) == 20 and len(list(folder.glob("shard-*.safetensors"))) == 4
    r = c[7]
    assert isinstance(r, Record) and set(r) == {"ids", "taps", "prompt_len"}
    assert r["taps"].shape[0] == len(r["ids"]) - 1 and r["taps"].dtype == torch.float16
    assert r["ids"].dtype == torch.long and 0 < r["prompt_len"] < len(r["ids"])


def test_two_gloo_processes_train_the_same_weights_as_one(tmp_path, tiny_corpus):
    target, corpus = tiny_corpus
    one = subprocess.run([sys.executable, *_cmd(target, corpus, tmp_path / "one", 6)], capture_output=True,
                         text=True, env=_env(), timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *_cmd(target, corpus, tmp_path / "two", 6, ("--grad-accum", "2"))],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = _params(tmp_path / "one"), _params(tmp_path / "two")
    assert a.keys() == b.keys()
    moved = max((a[k] - load_file(str(state.path(tmp_path / "one")))[k]).abs().max() for k in a)
    assert moved == 0
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst
    assert state.step_of(tmp_path / "two") == 6 and (tmp_path / "two" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_corpus):
    target, corpus = tiny_corpus
    steps, extra = 60, ("--save-every", "4")
    ref = subprocess.run([sys.executable, *_cmd(target, corpus, tmp_path / "ref", steps, extra)],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, *_cmd(target, corpus, out, steps, extra)], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (state.step_of(out) if state.path(out).is_file() else None) is None or state.step_of(out) < 8:
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = state.step_of(out)
    assert 8 <= killed_at < steps
    compact = state.progress_step(out)  # None: the kill fell between the compact state's two writes
    assert compact is None or compact <= killed_at  # the compact state (fp16) is written after the full one
    again = subprocess.run([sys.executable, *_cmd(target, corpus, out, steps, extra)], capture_output=True,
                           text=True, env=_env(), timeout=600)
    assert again.returncode == 0 and f"resumed at step {killed_at}" in again.stdout, again.stderr[-2000:]
    a, b = _params(tmp_path / "ref"), _params(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_kill_between_the_compact_writes_resumes_from_the_full_state(tmp_path, tiny_corpus):
    """The window the killed run above can land in, made on purpose: model.safetensors rewritten, progress.json
    still naming the old weights. With train_state/ there the run resumes exactly; without it, it says why."""
    import shutil

    from safetensors.torch import save_file

    target, corpus = tiny_corpus
    out = tmp_path / "out"
    first = subprocess.run([sys.executable, *_cmd(target, corpus, out, 4)], capture_output=True, text=True,
                           env=_env(), timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    w = load_file(str(out / "model.safetensors"))
    k = sorted(w)[0]
    save_file({**w, k: w[k] + 1}, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert state.progress_step(out) is None
    lone = tmp_path / "lone"  # the same folder as a fresh machine sees it: no train_state/
    shutil.copytree(out, lone, ignore=shutil.ignore_patterns(state.STATE))
    again = subprocess.run([sys.executable, *_cmd(target, corpus, out, 6)], capture_output=True, text=True,
                           env=_env(), timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed at step 4 (the compact state was left stale" in again.stdout, again.stdout[-2000:]
    assert state.progress_step(out) == 6
    refused = subprocess.run([sys.executable, *_cmd(target, corpus, lone, 6)], capture_output=True, text=True,
                             env=_env(), timeout=600)
    assert refused.returncode != 0 and "sha256 expected" in refused.stderr and "progress.json" in refused.stderr


def test_drafter_written_as_capped_shards_loads_the_same(tmp_path, tiny_corpus):
    from dflash2.checkpoint import load_tensors as load_state_dict
    from dflash2.train.trainer import TrainConfig, train

    target, corpus = tiny_corpus
    records = list(Corpus(corpus))
    c = TrainConfig(layers=1, block_size=6, top_k=4, rank=8, steps=2, seqs_per_step=2, anchors_per_seq=3,
                    tap_ids=(1, 2), mask_token_id=3, eval_every=100)
    train(target, tmp_path / "whole", records, c, log_fn=lambda m: None)
    train(target, tmp_path / "sharded", records, c, log_fn=lambda m: None, max_shard_mb=0.05)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(files) > 1 and all((tmp_path / "sharded" / f).stat().st_size <= 0.05 * 2**20 + 4096 for f in files)
    whole, sharded = load_state_dict(tmp_path / "whole"), load_state_dict(tmp_path / "sharded")
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)


@pytest.mark.slow
def test_gpu_train_script_at_toy_size_on_the_cpu(tmp_path, tiny_corpus):
    """scripts/gpu_train.sh end to end (corpus -> torchrun training -> draft vocabulary -> flat result)
    with DEVICE=cpu and a tiny target: the command a GPU machine runs, shown to work."""
    from dflash2.reference.load import load_pair

    target, _ = tiny_corpus
    out = tmp_path / "result"
    env = {**_env(), "PYTHON": sys.executable, "DEVICE": "cpu", "TARGET": str(target), "PROMPTS": "templated:10",
           "MAX_NEW": "16", "GEN_BATCH": "4", "SHARD": "4", "STEPS": "4", "SEQS": "2", "LAYERS": "1", "BLOCK": "6",
           "TOPK": "4", "SEL_RANK": "8", "TAPS": "1,2", "MASK": "3", "INIT": "", "DRAFT_VOCAB": "64", "THREADS": "1",
           "SHARD_MB": "0.05", "WORK": str(tmp_path / "work"), "OUT": str(out)}
    r = subprocess.run(["bash", "scripts/gpu_train.sh"], capture_output=True, text=True, env=env, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "draft_vocab.json" in names and "model.safetensors.index.json" in names
    assert all(p.stat().st_size <= 0.05 * 2**20 + 4096 for p in out.glob("model-*.safetensors"))
    load_pair(out, target)  # the result is a loadable DFlash2 drafter for this target


def test_a_partial_corpus_is_refused_unless_asked_for(tmp_path, tiny_corpus):
    import json
    import shutil

    from dflash2.errors import Dflash2Error
    from dflash2.train.corpus import load_corpus

    _, folder = tiny_corpus
    part = tmp_path / "part"
    part.mkdir()
    meta = json.loads((folder / "corpus.json").read_text())
    (part / "corpus.json").write_text(json.dumps(meta | {"complete": False}))
    first = sorted(folder.glob("shard-*.safetensors"))[0]
    shutil.copy(first, part / first.name)
    with pytest.raises(Dflash2Error, match="expected a complete corpus, found a partial one"):
        load_corpus(part)
    c = load_corpus(part, [1, 2], partial=True)
    assert len(c) == 6 and not c.complete and c[0]["ids"].tolist() == Corpus(folder)[0]["ids"].tolist()


def test_corpus_bench_times_both_generators_on_the_same_answers(tmp_path, tiny_corpus):
    """The benchmark command runs at toy size; its answers are the same greedy answers for both."""
    from dflash2.bench import genbench

    target, _ = tiny_corpus
    r = genbench.bench(target, ["Tell me about bees.", "What is 2 plus 2?", "Write a haiku."], batch=3, max_new=6,
                       repeats=1, taps=[1, 2], log=lambda m: None)
    assert set(r["tok_per_s"]) == {"transformers generate fp32", "transformers generate bf16 autocast",
                                   "transformers generate bf16 weights", "dflash2 corpus fp32 (+taps)",
                                   "dflash2 corpus bf16 (+taps)"}
    assert all(v > 0 for v in r["tok_per_s"].values()) and "x" in genbench.table(r)
    assert r["same_answers_fp32"] and r["same_answers_bf16"]  # the corpus generator's answers ARE generate's
