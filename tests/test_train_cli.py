"""dflash2-train's prompt options that need no training run: --vocab-words reaches make_prompts."""

from __future__ import annotations

import pytest

from dflash2.cli import train as train_cli
from dflash2.train.data import corpus_prompts, make_prompts, vocab_words


def test_vocab_words_reach_the_templated_prompts(targets):
    tokenizer = targets["llama"] / "tokenizer.json"
    words = vocab_words(tokenizer, 50)
    got = corpus_prompts("templated:100000", seed=1, words=words)
    assert set(got) == set(make_prompts(100000, 1, words=words)) - _bench()
    plain = corpus_prompts("templated:100000", seed=1)
    assert len(got) - len(plain) >= 0.9 * len(words)  # one templated prompt per word (a few may coincide)
    assert not set(got) & _bench()


def _bench() -> set[str]:
    from dflash2.prompts import default_prompts

    return set(default_prompts())


def test_vocab_words_flag_is_offered(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--help"])
    assert "--vocab-words N" in capsys.readouterr().out
