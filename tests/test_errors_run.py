"""dflash2-run / dflash2-export argument and environment errors: one line each, exit 2, no traceback,
nothing written (the export cases also prove they fail before any weight is loaded)."""

from __future__ import annotations

import errno
import io
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from dflash2 import manifest as mf
from dflash2 import tiny
from dflash2.cli import export as export_cli
from dflash2.cli import run as run_cli
from dflash2.runtime import session as rs
from dflash2.runtime.api import make_backend
from tests.errorcheck import one_line_error, snapshot


def _run(capsys, *args) -> str:
    assert run_cli.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err  # the buffer line comes first when the run got that far
    return one_line_error("\n".join(ln for ln in err.splitlines() if " allocating " not in ln), "dflash2-run")


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "-1,2"], "prompt ids [-1] are outside the vocabulary [0, "),
    (["--prompt", "hi", "--stop", ""], "--stop: expected a non-empty string, found ''"),
    (["--prompt", "hi", "--system", "be brief"], "--system: only used with --chat"),
    (["--prompt-ids", "1,2", "--chat"], "--chat: applies to a text --prompt"),
    (["--prompt", "caf\udce9"], "--prompt: expected UTF-8 text, found undecodable bytes at character 3"),
    (["--prompt", "hi", "--chat", "--system", "\udcfe\udcff"],
     "--system: expected UTF-8 text, found undecodable bytes at character 0"),
    (["--prompt", "hi", "--stop", "a\udcff"], "--stop: expected UTF-8 text, found undecodable bytes at character 1"),
])
def test_run_flag_errors(capsys, exports, args, message):
    assert message in _run(capsys, exports[("llama", 1)], *args)


def test_prompt_from_stdin(capsys, exports, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the model \xff")))
    assert "stdin: expected UTF-8 text, found byte 0xff at offset 10" in _run(capsys, exports[("qwen3", 2)],
                                                                                  "--prompt", "-")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("the model".encode())))
    assert run_cli.main([str(exports[("qwen3", 2)]), "--prompt", "-", "--max-new-tokens", "4", "--json"]) == 0


def test_buffers_that_do_not_fit_are_refused_before_allocating(capsys, exports, monkeypatch):
    monkeypatch.setattr(rs, "available_host_bytes", lambda: 1 << 20)  # 1 MiB left
    msg = _run(capsys, exports[("llama", 1)], "--prompt-ids", "1,2", "--json")
    assert "max_seq_len 6000: the KV and context buffers need" in msg and "0.0 GiB of memory is available" in msg


def test_run_prints_the_buffer_estimate_first(capsys, exports):
    assert run_cli.main([str(exports[("llama", 1)]), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    m = mf.load(exports[("llama", 1)])
    want = f"dflash2-run: allocating {rs.buffer_bytes(m, 6000) / 2**20:.1f} MiB of KV and context buffers"
    assert capsys.readouterr().err.startswith(want)


def test_bfloat16_on_the_cpu_provider_names_the_dtype(tmp_path):
    with pytest.raises(Exception, match="a bfloat16 export cannot run on ONNX Runtime's CPU provider"):
        make_backend(tmp_path, SimpleNamespace(dtype="bfloat16"), "onnxruntime")  # checked before any graph


@pytest.fixture
def nan_pair(tmp_path):
    """A pair whose weights fail to load: an export error about anything else came before loading."""
    d, t = tiny.make_pair(tmp_path / "in", family="llama", version=1)
    w = load_file(str(d / "model.safetensors"))
    w["norm.weight"][0] = float("nan")
    save_file(w, str(d / "model.safetensors"))
    return d, t


def _export(capsys, pair, out, *extra) -> str:
    code = export_cli.main(["--model", str(pair[0]), "--target", str(pair[1]), "--out", str(out), "--quiet", *extra])
    assert code == 2
    return one_line_error(capsys.readouterr().err, "dflash2-export")


def test_max_seq_len_bounded_by_the_targets_positions(tmp_path, capsys, nan_pair):
    before = snapshot(tmp_path)
    msg = _export(capsys, nan_pair, tmp_path / "o", "--max-seq-len", "9000")
    assert "--max-seq-len: expected <= max_position_embeddings 8192 of" in msg and "--beyond-max-positions" in msg
    # with the override the bound is passed: the export goes on to load the weights (and finds the NaN)
    assert "NaN" in _export(capsys, nan_pair, tmp_path / "o", "--max-seq-len", "9000", "--beyond-max-positions")
    assert snapshot(tmp_path) == before


def test_max_seq_len_defaults_to_the_targets_positions(tmp_path, capsys, nan_pair):
    import json

    cfg = nan_pair[1] / "config.json"
    doc = json.loads(cfg.read_text())
    doc["max_position_embeddings"] = 512
    cfg.write_text(json.dumps(doc))
    # no --max-seq-len: min(2048, 512) is taken, not refused; the export goes on to the weights (the NaN)
    assert "NaN" in _export(capsys, nan_pair, tmp_path / "o")
    assert "expected <= max_position_embeddings 512" in _export(capsys, nan_pair, tmp_path / "o",
                                                                "--max-seq-len", "2048")


def test_a_tokenizer_of_another_model_is_refused_with_the_numbers(tmp_path, capsys, nan_pair):
    tok = tmp_path / "small"
    tok.mkdir()
    n = tiny.make_tokenizer(tok, 600)  # the tiny target's vocabulary is 384
    shutil.copy(tok / "tokenizer.json", nan_pair[1] / "tokenizer.json")
    msg = _export(capsys, nan_pair, tmp_path / "o")
    assert f"tokenizer.json: vocabulary: expected token ids < 384" in msg and f"found ids up to {n - 1}" in msg
    assert "another model" in msg
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))


def test_a_tokenizer_past_the_embedding_is_refused(tmp_path):
    from dflash2.config import check_tokenizer_vocab
    from dflash2.errors import CheckpointError

    with pytest.raises(CheckpointError, match="expected token ids < 151936 .*found ids up to 151999"):
        check_tokenizer_vocab(tmp_path / "tokenizer.json", 152000, 151936)
    with pytest.raises(CheckpointError, match="expected about 151936 token ids .*found 564 ids"):
        check_tokenizer_vocab(tmp_path / "tokenizer.json", 564, 151936)
    check_tokenizer_vocab(tmp_path / "tokenizer.json", 151669, 151936)  # Qwen3: padded rows are fine
    check_tokenizer_vocab(tmp_path / "tokenizer.json", 32011, 32064)  # Phi-3


def test_the_runtime_refuses_a_swapped_tokenizer(tmp_path, capsys, exports):
    from dflash2.runtime.api import Runtime

    copy = tmp_path / "copy"
    shutil.copytree(exports[("llama", 1)], copy)
    tiny.make_tokenizer(tmp_path, 600)
    shutil.copy(tmp_path / "tokenizer.json", copy / "tokenizer.json")
    rt = Runtime(copy, verify=False)  # the manifest's sha256 would catch the swap first
    with pytest.raises(Exception, match="expected token ids < 384"):
        rt.prompt_ids(text="hello")


def test_output_under_proc_fails_before_loading(tmp_path, capsys, nan_pair):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    msg = _export(capsys, nan_pair, Path("/proc/dflash2-out"))
    assert "cannot create the output folder in /proc: the filesystem refuses new folders there" in msg


def test_read_only_filesystem_is_named(tmp_path, capsys, nan_pair, monkeypatch):
    # no read-only mount is available to an unprivileged test: the kernel's answer (EROFS) is injected
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **k):
        if self.parent == tmp_path / "ro":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(Path, "mkdir", mkdir)
    msg = _export(capsys, nan_pair, tmp_path / "ro" / "out")
    assert msg.endswith("it is on a read-only filesystem") and "permission denied" not in msg
    assert list((tmp_path / "ro").iterdir()) == []


def test_deleted_tokenizer_refuses_only_what_needs_it(tmp_path, exports, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(exports[("llama", 1)], copy)
    (copy / "tokenizer.json").unlink()
    assert run_cli.main([str(copy), "--prompt-ids", "1,2", "--max-new-tokens", "3", "--json"]) == 0
    capsys.readouterr()
    for args in (["--prompt", "the model"], ["--prompt-ids", "1,2", "--stop", "x"]):
        msg = _run(capsys, copy, *args, "--max-new-tokens", "3")
        assert "expected tokenizer.json (copied from the target at export), found none; text prompts, --stop" in msg
    (copy / "tokenizer_config.json").write_text("{}")  # changed, not deleted: still refused
    msg = _run(capsys, copy, "--prompt-ids", "1,2")
    assert "files.tokenizer_config.json: expected " in msg and " bytes, found 2" in msg


def test_chat_template_syntax_error_is_named(tmp_path, exports):
    from dflash2.runtime.text import Text, TokenizerError

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(exports[("qwen3", 2)] / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{% for m in messages %}{{ m"}')
    with pytest.raises(TokenizerError, match=r"tok: chat template: expected a jinja template, found a syntax error"):
        Text(folder).encode("hi", chat=True)


@pytest.mark.parametrize("args,message", [
    (["--print-trtexec", "--manifest-only"], "--print-trtexec and --manifest-only: give one"),
    (["--print-trtexec", "--force"], "--force: no effect with --print-trtexec"),
    (["--manifest-only", "--timing-cache", "t.cache", "--workspace", "64"],
     "--timing-cache, --workspace: no effect with --manifest-only"),
])
def test_build_flags_without_effect_are_errors(tmp_path, capsys, args, message):
    from dflash2.cli import build as build_cli

    before = snapshot(tmp_path)
    assert build_cli.main([str(tmp_path / "export"), "--out", str(tmp_path / "eng"), *args]) == 2
    assert message in one_line_error(capsys.readouterr().err, "dflash2-build")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats: expected >= 1, found 0"),
    (["--json", "{export}/manifest.json"], "--json {export}/manifest.json lies inside the FOLDER folder"),
    (["--json", "{tmp}/missing/r.json"], "--json {tmp}/missing/r.json: expected an existing folder {tmp}/missing"),
    (["--plot", "{tmp}"], "--plot {tmp}: expected a file name, found a folder"),
])
def test_bench_output_files_checked_before_the_run(tmp_path, exports, capsys, args, message):
    from dflash2.cli import bench as bench_cli

    export = exports[("llama", 1)]
    fill = {"export": export, "tmp": tmp_path}
    before = snapshot(export, tmp_path)
    assert bench_cli.main([str(export), "--max-new-tokens", "2", *(x.format(**fill) for x in args)]) == 2
    assert message.format(**fill) in one_line_error(capsys.readouterr().err, "dflash2-bench")
    assert snapshot(export, tmp_path) == before


def test_compare_negative_tolerance(exports, capsys):
    from dflash2.cli import compare as compare_cli

    assert compare_cli.main([str(exports[("llama", 1)]), "--atol", "-1"]) == 2
    assert "--atol: expected a finite tolerance >= 0, found -1.0" in one_line_error(capsys.readouterr().err,
                                                                                    "dflash2-compare")
    assert compare_cli.main([str(exports[("llama", 1)]), "--rtol", "inf"]) == 2  # inf would pass anything
    assert "--rtol: expected a finite tolerance >= 0, found inf" in one_line_error(capsys.readouterr().err,
                                                                                   "dflash2-compare")


def test_bench_policies_on_a_v1_drafter_are_refused(exports, capsys):
    from dflash2.cli import bench as bench_cli

    export = exports[("llama", 1)]
    before = snapshot(export)
    assert bench_cli.main([str(export), "--max-new-tokens", "2", "--policies", "selector"]) == 2
    assert "drafter is DFlash v1 (no candidate selector, no lattice): only its own drafts are measured" in \
        one_line_error(capsys.readouterr().err, "dflash2-bench")
    assert snapshot(export) == before


def test_make_tiny_seed_range_and_no_half_pair(tmp_path, capsys, monkeypatch):
    from dflash2.cli import make_tiny

    assert make_tiny.main(["--out", str(tmp_path / "a"), "--seed", str(2**70)]) == 2
    assert f"--seed: expected 0..{2**63 - 2}, found {2**70}" in one_line_error(capsys.readouterr().err,
                                                                               "dflash2-make-tiny")
    assert make_tiny.main(["--out", str(tmp_path / "a"), "--seed", "-1"]) == 2
    capsys.readouterr()

    def interrupted(*args, **kw):  # Ctrl-C after the target is written, while the drafter is
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "make_drafter", interrupted)
    assert make_tiny.main(["--out", str(tmp_path / "a")]) == 130
    assert "interrupted; nothing was written" in capsys.readouterr().err
    assert list(tmp_path.rglob("*")) in ([], [tmp_path / "a"]), list(tmp_path.rglob("*"))  # no target, no temp
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_trained_taps_are_distinct_on_tiny_targets():
    from dflash2.config import default_target_layer_ids, distinct_target_layer_ids

    assert distinct_target_layer_ids(30, 3) == (1, 14, 27)  # z-lab's rule where it has room: unchanged
    assert distinct_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert distinct_target_layer_ids(4, 3) == (1, 2)  # z-lab: (1, 1, 1), one layer tapped three times
    assert distinct_target_layer_ids(5, 3) == (1, 2, 3)
    assert distinct_target_layer_ids(2, 3) == (1,) and distinct_target_layer_ids(1, 3) == (0,)  # never < 0
    assert all(0 <= t < L for L in range(1, 40) for n in range(1, 6) for t in distinct_target_layer_ids(L, n))
    assert default_target_layer_ids(4, 3) == (1, 1, 1)  # a checkpoint's missing taps still read z-lab's way


def test_make_tiny_never_writes_over_a_folder(tmp_path, capsys):
    from dflash2.cli import make_tiny

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"mine": true}')
    before = snapshot(tmp_path)
    assert make_tiny.main(["--out", str(tmp_path)]) == 2
    assert "target: exists; dflash2-make-tiny writes only new folders" in one_line_error(
        capsys.readouterr().err, "dflash2-make-tiny")
    assert make_tiny.main(["--out", str(tmp_path / "new"), "--block-size", "1"]) == 2
    assert "--block-size / --layers: expected 2..256 / 1..64, found 1 / 1" in capsys.readouterr().err
    assert make_tiny.main(["--out", str(tmp_path / "new"), "--layers", "100000"]) == 2  # was OverflowError
    assert "found 8 / 100000" in capsys.readouterr().err
    assert make_tiny.main(["--out", str(tmp_path / "target")]) == 2  # a checkpoint: no subfolders written in it
    assert "holds a checkpoint or an export (config.json)" in one_line_error(
        capsys.readouterr().err, "dflash2-make-tiny")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats: expected >= 1, found 0"),
    (["--threads", "-3"], "--threads: expected >= 1, found -3"),
    (["--json", "{export}/manifest.json"], "--json {export}/manifest.json lies inside the FOLDER 1 folder"),
    (["--prompts", "{tmp}/empty.json"], "expected at least one prompt, found an empty list"),
])
def test_bench_quant_never_writes_over_an_input(tmp_path, exports, capsys, args, message):
    """Its --json once replaced an export's manifest (exit 0); now checked before the run like dflash2-bench's."""
    from dflash2.cli import bench_quant

    export = exports[("llama", 1)]
    (tmp_path / "empty.json").write_text("[]")
    fill = {"export": export, "tmp": tmp_path}
    before = snapshot(export, tmp_path)
    assert bench_quant.main([str(export), "--max-new-tokens", "2", *(x.format(**fill) for x in args)]) == 2
    assert message.format(**fill) in one_line_error(capsys.readouterr().err, "dflash2-bench-quant")
    assert snapshot(export, tmp_path) == before


def test_draft_len_is_checked_even_without_speculation(capsys, exports):
    assert "draft length expected 1..7 (the drafter's block size - 1), found 99" in _run(capsys, exports[("llama", 1)], "--prompt-ids", "1,2",
                                                          "--draft-len", "99", "--no-spec")


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,2", "--draft-len", "2", "--no-spec"], "--draft-len 2: no effect with --no-spec"),
    (["--prompt-ids", "1,2", "--temperature", "0", "--top-k", "5", "--seed", "3"],
     "--top-k, --seed: no effect at temperature 0 (greedy decoding); add --temperature T > 0"),
    (["--prompt-ids", "1,2", "--top-p", "0.9"], "--top-p: no effect at temperature 0 (greedy decoding, the model "
                                                "default)"),
])
def test_run_flags_without_effect_are_errors(capsys, exports, args, message):
    assert message in _run(capsys, exports[("llama", 1)], *args)


@pytest.mark.parametrize("spec,message", [
    ("{tmp}", "expected a prompt file (a JSON list or one prompt per line), found a folder"),
    ("{tmp}/empty.json", "empty.json: expected at least one prompt, found an empty list"),
    ("sharegpt:eval:0", "--prompts sharegpt:eval:0: expected a count N >= 1 (or none for all), found 0"),
])
@pytest.mark.parametrize("cli", ["bench", "bench_quant"])
def test_bench_prompt_specs_are_checked(tmp_path, exports, capsys, spec, message, cli):
    import importlib

    (tmp_path / "empty.json").write_text("[]")
    main = importlib.import_module(f"dflash2.cli.{cli}").main
    before = snapshot(exports[("llama", 1)], tmp_path)
    assert main([str(exports[("llama", 1)]), "--prompts", spec.format(tmp=tmp_path), "--max-new-tokens", "2"]) == 2
    prog = "dflash2-bench" if cli == "bench" else "dflash2-bench-quant"
    assert message in one_line_error(capsys.readouterr().err, prog)
    assert snapshot(exports[("llama", 1)], tmp_path) == before


def test_stdout_closed_early_is_one_line_not_a_traceback(exports):
    """`dflash2-run ... | head -c 5`: the pipe closes while the run still prints; one line on stderr, the shell's
    SIGPIPE status (141), no BrokenPipeError traceback."""
    import subprocess

    code = (f"import sys; from dflash2.cli import run; sys.exit(run.main([{str(exports[('llama', 1)])!r}, "
            "'--prompt-ids', '1,2,3', '--max-new-tokens', '24']))")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # closed before the run writes a byte, as `head -c 5` is after its 5 (deterministic here)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "standard output was closed (broken pipe)" in err


@pytest.mark.parametrize("extra,message", [
    (["--quant-block-size", "64"], "--quant-block-size: no effect without --quantize"),
    (["--quant-target-only", "--quant-keep-head"], "--quant-keep-head, --quant-target-only: no effect without "
                                                    "--quantize"),
    (["--quantize", "int4", "--quant-block-size", "1048576"], "expected a power of two in 16..256"),
    (["--quantize", "int4", "--quant-block-size", "0"], "expected a power of two in 16..256"),
    (["--quant-drafter", "int8-dynamic"], "--quant-drafter: no effect without --quantize"),
    (["--quantize", "int4", "--quant-drafter", "int8-dynamic", "--quant-drafter-block-size", "64"],
     "--quant-drafter-block-size: no effect with --quant-drafter int8-dynamic"),
    (["--quantize", "int4", "--quant-drafter-block-size", "8"], "--quant-drafter-block-size: expected a power of two"),
    (["--quantize", "int4", "--quant-target-only", "--quant-drafter", "int8"],
     "--quant-drafter / --quant-drafter-block-size: expected with --quantize int4 or int8 and a quantized drafter, "
     "found --quant-target-only"),
    (["--quantize", "int8_qdq", "--quant-drafter", "int8"], "found --quantize int8_qdq"),
    (["--out", "\udcff\udcfe"], "--out: expected UTF-8 text, found undecodable bytes at character 0"),  # not a
    # TypeError from ONNX's checker (argv bytes that are not UTF-8 arrive as lone surrogates)
    (["--quantize", "int4", "--quant-drafter", "int8-dynamic", "--target-attention", "plain"],
     "--quant-drafter int8-dynamic: expected the fused-op graphs (--target-attention gqa"),
])
def test_quantization_flags_are_checked_before_loading(tmp_path, capsys, nan_pair, extra, message):
    before = snapshot(tmp_path)
    assert message in _export(capsys, nan_pair, tmp_path / "o", *extra)  # not the NaN: refused before loading
    assert snapshot(tmp_path) == before


def test_a_file_given_as_the_export_folder_is_named_a_file(tmp_path, capsys):
    f = tmp_path / "manifest.json"
    f.write_text("{}")
    assert "expected an export or engine folder, found a file (give the folder that holds manifest.json)" in \
        _run(capsys, f, "--prompt", "hi")


def test_demo_never_replaces_a_folder_it_did_not_write(tmp_path):
    from dflash2.cli.demo import ensure_export
    from dflash2.folders import OutputError

    drafter, target = tiny.make_pair(tmp_path / "pair")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match="dflash2-demo writes its export here and replaces only a folder dflash2 "
                                          "wrote") as e:  # it was "--force replaces only ...": demo has no --force
        ensure_export(drafter, target, tmp_path / "mine", True)
    assert "--force" not in str(e.value)
    assert snapshot(tmp_path) == before


def test_the_demos_export_runs_and_is_reused(tmp_path):
    """dflash2-demo's export is a runnable folder (its stamp is not an unlisted file that dflash2-run refuses: the
    README's main command once failed so) and a second call with the same checkpoints exports nothing."""
    from dflash2.cli.demo import STAMP, ensure_export
    from dflash2.runtime.api import Runtime

    drafter, target = tiny.make_pair(tmp_path / "pair")
    out = tmp_path / "out"
    ensure_export(drafter, target, out, True)
    rt = Runtime(out)  # checks every file of the folder against the manifest
    assert rt.generate([5, 17, 42], 4).ids
    before = (out / "manifest.json").stat().st_mtime_ns
    ensure_export(drafter, target, out, True)
    assert (out / "manifest.json").stat().st_mtime_ns == before and (out / STAMP).is_file()
