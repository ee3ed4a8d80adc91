"""Argument helpers shared by the CLIs: token-id lists, prompts from argv or stdin."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dflash2.errors import Dflash2Error, check_threads, cores  # noqa: F401 (re-exported)
from dflash2.folders import check_apart, check_name, check_writable


def threads_arg(s: str) -> int:
    """argparse type of --threads: an integer in 1..cores()."""
    try:
        v = int(s)
        check_threads(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {s!r}") from None
    except Dflash2Error as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--threads: ")) from None
    return v


def parse_ids(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip()
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer (expected e.g. 1,2,3)") from None
    return out


def read_prompt(prompt: str) -> str:
    """`-` reads the prompt from stdin; bytes that are not UTF-8 are named, not passed to the tokenizer."""
    if prompt == "-":
        if sys.stdin is None or getattr(sys.stdin, "closed", False):
            raise Dflash2Error("stdin: expected the prompt (--prompt -), found standard input closed")
        try:
            data = sys.stdin.buffer.read()
        except (OSError, ValueError) as e:  # a closed or unreadable descriptor
            raise Dflash2Error(f"stdin: expected the prompt (--prompt -), found it unreadable ({e})") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Dflash2Error(f"stdin: expected UTF-8 text, found byte 0x{data[e.start]:02x} at offset {e.start}") \
                from None
    return utf8_arg(prompt, "--prompt")


def utf8_arg(value: str, flag: str) -> str:
    """A text flag as given: argv bytes that were not UTF-8 arrive as lone surrogates, which the tokenizer
    and stop-string matching cannot take; named here instead."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Dflash2Error(f"{flag}: expected UTF-8 text, found undecodable bytes at character {e.start}") from None
    return value


def negative_ids_joined(argv: list[str]) -> list[str]:
    """`--prompt-ids -1,2` would read as an unknown option to argparse: join it as `--prompt-ids=-1,2`
    so parse_ids and the vocabulary check can name the bad id."""
    out = []
    for arg in argv:
        if out and out[-1] == "--prompt-ids" and re.fullmatch(r"-\d[\d,\s-]*", arg):
            out[-1] = f"--prompt-ids={arg}"
        else:
            out.append(arg)
    return out


def check_output_file(path: Path | None, flag: str, inputs) -> None:
    """A file a CLI writes when its work is done (--json, --plot): checked before the work, so a bad
    path does not waste a run, and never inside an input folder (e.g. over an export's manifest), nor one of the
    input files (`--combine A.json --json A.json`). inputs: flag -> path, or (flag, path) pairs."""
    if path is None:
        return
    check_name(path, flag)
    check_apart(path, inputs, out_flag=flag)
    if path.is_dir():
        raise Dflash2Error(f"{flag} {path}: expected a file name, found a folder")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise Dflash2Error(f"{flag} {path}: expected an existing folder {parent}, found none")
    check_writable(path, parent)


def add_sampling_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """--temperature / --top-k / --top-p / --seed; unset ones come from the target's generation_config.json
    (greedy when it asks for no sampling). sweep: --temperature takes a comma-separated list."""
    g = p.add_argument_group("sampling (lossless: the output has the target-only sampling distribution)")
    if sweep:
        g.add_argument("--temperature", type=_floats, metavar="T[,T...]",
                       help="temperature(s); several: one interleaved run per temperature (0 = greedy)")
    else:
        g.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation_config.json)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="keep the smallest set of top tokens holding this mass (1 = off)")
    g.add_argument("--seed", type=int, help="seed of the sampling stream (default 0): same seed, same text")


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected numbers separated by commas (e.g. 0,0.7,1)") from None


def sampling_options(a: argparse.Namespace, temperature: float | None) -> dict:
    """The sampling flags given, with this temperature (None and unset flags are left to the model's
    generation_config.json)."""
    given = {"temperature": temperature, "top_k": a.top_k, "top_p": a.top_p, "seed": a.seed}
    return {k: v for k, v in given.items() if v is not None}


def sampling_of(rt, a: argparse.Namespace):
    """The Sampling the flags ask for on this runtime."""
    return rt.sampling(**sampling_options(a, a.temperature))
