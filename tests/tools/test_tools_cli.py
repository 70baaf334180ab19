"""The ``bcp`` command line: help for every command, usage errors, and the installed entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from bcp.cli import build_parser, main

COMMANDS = ["inspect", "verify", "export", "convert", "edit", "copy", "report"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bcp {command}") and "--role" in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS) and "examples:" in out
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMANDS)


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: COMMAND"),
    (["export", "ckpt", "out"], "the following arguments are required: --to"),
    (["export", "ckpt", "--to", "onnx", "out"], "invalid choice: 'onnx'"),
    (["export", "ckpt", "--to", "safetensors", "out", "--max-shard-size", "lots"], "not a size: 'lots'"),
    (["edit", "a", "b", "--dtype", "float128"], "unknown dtype 'float128'"),
    (["convert", "a", "b", "--tie", "lm_head.weight"], "expected ALIAS=KEY"),
    (["convert", "a", "b", "--to", "hf"], "invalid choice: 'hf'"),
])
def test_usage_errors_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["edit", "copy", "convert"])
@pytest.mark.parametrize("argv,src", [
    (["--compress", "SRC", "OUT"], "SRC"), (["SRC", "--compress", "OUT"], "SRC"), (["SRC", "OUT", "--compress"], "SRC"),
    (["--compress=zstd", "SRC", "OUT"], "SRC"), (["--compress", "zstd", "SRC", "OUT"], "SRC"),
    (["SRC", "OUT", "--compress", "zstd"], "SRC"), (["--compress", "--", "zstd", "OUT"], "zstd"),
])
def test_compress_takes_the_next_word_for_its_codec_only_where_it_names_one(command, argv, src):
    args = build_parser().parse_args([command, *argv])
    assert (args.src, args.out, args.compress) == (src, "OUT", "zstd")


@pytest.mark.parametrize("argv", [
    ["inspect", "{missing}"], ["verify", "{missing}"], ["export", "{missing}", "--to", "safetensors", "{out}"],
    ["convert", "--from", "bcp", "{missing}", "{out}"], ["convert", "--from", "hf", "{missing}", "{out}"],
    ["convert", "--from", "dcp", "{missing}", "{out}", "--trust-pickle"], ["edit", "{missing}", "{out}"],
])
def test_bad_paths_exit_1_naming_the_path(argv, tmp_path, capsys):
    missing, out = str(tmp_path / "missing"), str(tmp_path / "out")
    assert main([a.format(missing=missing, out=out) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"bcp {argv[0]}: error: ") and missing in err
    assert not os.path.exists(out)


def test_unsupported_conversion_is_refused(tmp_path, capsys):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert main(["convert", "--to", "dcp", str(tmp_path / "dcp"), str(tmp_path / "out")]) == 1
    assert "converting dcp to dcp is not supported" in capsys.readouterr().err


def test_the_console_script_is_installed_and_runs():
    script = shutil.which("bcp", path=os.path.dirname(sys.executable))  # installed from [project.scripts]
    assert script is not None, "the bcp console script is not installed: re-run `make setup`"
    run = subprocess.run([script, "verify", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: bcp verify")
