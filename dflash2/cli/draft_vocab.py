"""dflash2-draft-vocab: write a drafter's draft_vocab.json from a corpus of the target's answers.

The N ids the target emits most often (ties: lower id) plus its EOS ids. dflash2-export then
gives the drafter an LM head over those N rows only; verification still covers the whole
vocabulary, so output is unchanged (lossless) and only the draft gets cheaper.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash2.cli import CliError, cli_main
from dflash2.errors import Dflash2Error, require_extra


@cli_main("dflash2-draft-vocab")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-draft-vocab", "export", 'torch', 'safetensors')
    p = argparse.ArgumentParser(prog="dflash2-draft-vocab", description=__doc__)
    p.add_argument("--drafter", required=True, type=Path, help="drafter folder to write draft_vocab.json into")
    p.add_argument("--target", required=True, type=Path, help="target folder (vocabulary size, EOS ids)")
    p.add_argument("--corpus", required=True, type=Path, nargs="+", help="corpus folder(s): a tap corpus from dflash2-train or an id corpus from dflash2-corpus")
    p.add_argument("--size", required=True, type=int, help="number of ids to keep")
    p.add_argument("--force", action="store_true",
                   help="replace an existing draft_vocab.json (only one dflash2 wrote)")
    a = p.parse_args(argv)
    from dflash2 import draft_vocab
    from dflash2.folders import check_replaceable_file
    from dflash2.inputs import check_input

    for flag, path in [("--drafter", a.drafter), ("--target", a.target)] + [("--corpus", c) for c in a.corpus]:
        check_input(path, flag)
    from dflash2.config import load_drafter_config, load_target_config
    from dflash2.train.data import corpus_answers

    try:
        tc, dc = load_target_config(a.target), load_drafter_config(a.drafter)
        if dc.vocab_size != tc.vocab_size:  # a 49,152-id vocabulary once went into a 384-row drafter this way
            raise Dflash2Error(f"--target {a.target}: expected the drafter's target (config.json vocab_size "
                               f"{dc.vocab_size}, as in {a.drafter / 'config.json'}), found vocab_size "
                               f"{tc.vocab_size}: this drafter was not made for this target")
        answers = [ans for c in a.corpus for ans in corpus_answers(c)]
        ids = draft_vocab.from_sequences(answers, a.size, tc.vocab_size, tc.eos_token_ids)
        draft_vocab.check_ids(ids, dc.vocab_size, draft_vocab.min_size(dc), str(a.drafter))
        # last of the checks (what is wrong with the inputs is said first), still before anything is written
        check_replaceable_file(draft_vocab.path_in(a.drafter), a.force, draft_vocab.is_ours, "a draft vocabulary")
        path = draft_vocab.write(a.drafter, ids, tc.vocab_size, f"dflash2-draft-vocab --size {a.size} over "
                                 f"{len(answers)} answers of {[c.name for c in a.corpus]}", a.size)
    except OSError as e:  # a read-only or full disk: the old file (if any) is untouched (written atomically)
        raise CliError(f"{a.drafter}: could not write draft_vocab.json ({e.strerror}); nothing was changed",
                       status=1) from None
    covered = draft_vocab.coverage(answers, ids)
    print(f"wrote {path}: {len(ids)} ids covering {covered:.1%} of {sum(map(len, answers))} answer tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
