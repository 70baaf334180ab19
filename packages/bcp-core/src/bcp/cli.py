"""The ``bcp`` command: one sub-command per tool of :mod:`bcp.tools`.

Exit status: 0 on success, 1 when the checkpoint is bad or the operation failed (with the reason
on stderr), 2 for a malformed command line. Progress bars go to stderr, and only on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from bcp.chunk_codecs import CODECS, Compression
from bcp.errors import CheckpointError
from bcp.storage import is_url
from bcp.tools import (
    CastRules,
    NameRules,
    convert_bcp_to_dcp,
    convert_dcp_to_bcp,
    convert_hf_to_bcp,
    copy_checkpoint,
    edit_checkpoint,
    export_safetensors,
    format_summary,
    open_checkpoint,
    progress_for,
    report,
    summarize,
    verify_checkpoint,
)
from bcp.tools.edit import SOURCE
from bcp.tools.op_summary import STRAGGLER_RATIO, STRAGGLER_SECONDS
from bcp.tools.units import human_bytes, parse_size

_EPILOG = """examples:
  bcp inspect ckpt/ --filter 'model/*.weight'
  bcp verify ckpt/
  bcp export ckpt/ --to safetensors hf_out/ --config hf_config/ --dtype bfloat16
  bcp convert --from hf hf_model/ ckpt/
  bcp convert --from dcp dcp_ckpt/ ckpt/ --trust-pickle
  bcp convert --to dcp ckpt/ dcp_out/
  bcp edit ckpt/ new_ckpt/ --drop 'optimizer/*' --dtype bfloat16
  bcp edit ckpt/ compressed/ --compress
  bcp copy ckpt/ s3://bucket/elsewhere/ --generation 12
  bcp report ckpt/ --heatmap heat.png --gantt gantt.png --trace trace.json
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError) as exc:
        print(f"bcp {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bcp {args.command}: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``--compress`` (on the commands that have it) takes the next word as
    its codec only where that word names one: ``bcp edit --compress SRC OUT`` compresses SRC with the
    default codec, where argparse alone would take SRC for the codec's name. ``--compress=CODEC``
    always names it."""

    compress_flag = False  # the commands with --compress[=CODEC] set it

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self.compress_flag and args is not None:  # a command's parser: always given its words
            args = _codec_named(args)
        return super().parse_known_args(args, namespace)


def _codec_named(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--compress`` that no codec's name follows written ``--compress=<default>``."""
    words = list(args)
    for i, word in enumerate(words):
        if word == "--":  # what follows is positional
            break
        if word == "--compress" and (i + 1 == len(words) or words[i + 1] not in CODECS):
            words[i] = f"--compress={Compression().codec}"
    return words


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bcp", description="Inspect, verify, export, convert, edit and copy bcp checkpoints; report on saves and loads.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = _command(commands, "inspect", _inspect, "what a checkpoint holds (reads only its manifest)")
    _source(inspect, "PATH")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    inspect.add_argument("--filter", action="append", default=[], metavar="GLOB",
                         help="list only entries whose name matches (repeatable; '*' crosses '/' and '.')")

    verify = _command(commands, "verify", _verify, "check completeness and every checksum; exit 1 on any problem")
    _source(verify, "PATH")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.add_argument("--decode", action="store_true",
                        help="also decode compressed chunks and check their raw bytes (default: their stored bytes)")
    _quiet(verify)

    export = _command(commands, "export", _export, "write a component as a Hugging Face safetensors folder")
    _source(export, "PATH", generation=False)
    export.add_argument("--to", required=True, choices=["safetensors"], help="output format")
    export.add_argument("out", metavar="OUT", help="output folder (created if needed)")
    export.add_argument("--component", default="model", help="component to export (default: model)")
    export.add_argument("--max-shard-size", default="5GB", type=_size, metavar="SIZE",
                        help="largest file before splitting, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    export.add_argument("--config", metavar="PATH", help="model folder or config.json to copy into OUT; with "
                        "transformers installed it also tells which weights are tied (written once)")
    export.add_argument("--keep-tied", action="store_true", help="write tied weights under every name")
    export.add_argument("--overwrite", action="store_true", help="replace safetensors files already in OUT")
    _quiet(export)
    _edit_rules(export, "names as written to the files (without 'COMPONENT/')")

    convert = _command(commands, "convert", _convert, "convert between bcp, PyTorch DCP and Hugging Face folders")
    convert.add_argument("src", metavar="SRC", help="checkpoint or folder to convert")
    convert.add_argument("out", metavar="OUT", help="new (or empty) output folder")
    convert.add_argument("--from", dest="source_format", choices=["auto", "bcp", "dcp", "hf"], default="auto",
                         help="format of SRC (default: detected)")
    convert.add_argument("--to", dest="target_format", choices=["bcp", "dcp"],
                         help="format of OUT (default: bcp, or dcp when SRC is bcp)")
    convert.add_argument("--trust-pickle", action="store_true",
                         help="DCP metadata is a Python pickle and unpickling runs code: pass this only for a "
                              "source you trust (needed to read DCP, and bcp checkpoints saved with pickles)")
    convert.add_argument("--role", help="role sub-checkpoint of a bcp SRC")
    convert.add_argument("--component", default="model", help="component the hf weights go to (default: model)")
    convert.add_argument("--tie", action="append", default=None, metavar="ALIAS=KEY", type=_tie,
                         help="hf: ALIAS shares KEY's tensor (repeatable); default: the ties config.json implies")
    _compression_options(convert, keeps=False)
    _edit_rules(convert, "bcp names (model/<key>, ...); to bcp only")
    _quiet(convert)

    edit = _command(commands, "edit", _edit, "write an edited copy: rename/drop entries, cast dtypes")
    edit.add_argument("src", metavar="SRC", help="checkpoint to read (never modified)")
    edit.add_argument("out", metavar="OUT", help="new (or empty) folder for the edited checkpoint")
    edit.add_argument("--role", help="role sub-checkpoint of SRC")
    edit.add_argument("--consolidate", action="store_true", help="store every tensor whole instead of as saved")
    _compression_options(edit, keeps=True)
    _edit_rules(edit, "full names (model/<fqn>, optimizer/state/<fqn>/<key>, ...)")
    _quiet(edit)

    copy = _command(commands, "copy", _copy, "copy one generation as a checkpoint of its own (self-contained)")
    copy.add_argument("src", metavar="SRC", help="checkpoint to read (never modified)")
    copy.add_argument("out", metavar="OUT", help="new (or empty) folder or URL for the copy")
    copy.add_argument("--role", help="role sub-checkpoint of SRC")
    copy.add_argument("--generation", type=int, help="a committed generation other than the newest")
    _compression_options(copy, keeps=True)
    _quiet(copy)

    monitor = _command(commands, "report", _report, "where a save's or load's time went, per rank and phase")
    monitor.add_argument("path", metavar="PATH|LOG", help="checkpoint path or URL (its bcp-metrics/ log), or a log file")
    monitor.add_argument("--role", help="role sub-checkpoint whose log to read (as passed to bcp.save)")
    monitor.add_argument("--index", type=int, default=-1, help="which operation of the log (default: -1, the last)")
    monitor.add_argument("--op", choices=["save", "load"], help="count only saves or only loads")
    monitor.add_argument("--phase", help="phase to colour the heat map and rank the slowest ranks by, or 'total' "
                         "(default: the phase with the widest spread between ranks)")
    monitor.add_argument("--straggler-seconds", type=float, default=STRAGGLER_SECONDS, metavar="S",
                         help="flag a straggler only this many seconds above its phase's median "
                         f"(default: {STRAGGLER_SECONDS:g})")
    monitor.add_argument("--straggler-ratio", type=float, default=STRAGGLER_RATIO, metavar="X",
                         help=f"... and this many times the median (default: {STRAGGLER_RATIO:g})")
    monitor.add_argument("--heatmap", metavar="PNG", help="draw the heat map over the topology (matplotlib)")
    monitor.add_argument("--gantt", metavar="PNG", help="draw the per-rank timeline as a Gantt chart (matplotlib)")
    monitor.add_argument("--ranks", type=_ranks, metavar="R,R,...", help="ranks in the Gantt chart (default: 64)")
    monitor.add_argument("--trace", metavar="JSON", help="write the timeline as Chrome trace / Perfetto JSON")
    monitor.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _command(commands: Any, name: str, run: Callable[[argparse.Namespace], int], text: str) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=text, description=text)
    sub.set_defaults(run=run)
    return sub


def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn off a terminal anyway)")


def _source(parser: argparse.ArgumentParser, metavar: str, generation: bool = True) -> None:
    parser.add_argument("path", metavar=metavar, help="checkpoint path (the folder holding gen-* folders)")
    parser.add_argument("--role", help="role sub-checkpoint (as passed to bcp.save)")
    if generation:
        parser.add_argument("--generation", type=int, help="a committed generation other than the newest")


def _compression_options(parser: _Parser, keeps: bool) -> None:
    """``--compress[=CODEC]`` and (for a bcp source, whose compression is otherwise kept) ``--decompress``."""
    parser.compress_flag = True
    group = parser.add_mutually_exclusive_group()
    default = SOURCE if keeps else None
    group.add_argument("--compress", nargs="?", const=Compression().codec, default=default, choices=CODECS,
                       metavar="CODEC", help=f"store the data compressed with CODEC (one of {', '.join(CODECS)}; "
                       f"default {Compression().codec})" + ("; without this or --decompress, as the source is "
                                                             "stored" if keeps else ""))
    if keeps:
        group.add_argument("--decompress", dest="compress", action="store_const", const=None, default=default,
                           help="store the data uncompressed (format version 1 or 2, which every bcp reads)")


def _edit_rules(parser: argparse.ArgumentParser, names: str) -> None:
    group = parser.add_argument_group("rules", f"patterns match the source {names}; renames apply last")
    group.add_argument("--drop", action="append", default=[], metavar="GLOB", help="leave out matching entries")
    group.add_argument("--rename", action="append", nargs=2, default=[], metavar=("REGEX", "REPLACEMENT"),
                       help="rename with re.sub, in order (repeatable)")
    group.add_argument("--dtype", action="append", default=[], metavar="[GLOB=]DTYPE", type=_cast,
                       help="cast floating-point tensors (matching GLOB) to DTYPE, e.g. bfloat16; last match wins")


def _inspect(args: argparse.Namespace) -> int:
    summary = summarize(open_checkpoint(args.path, role=args.role, generation=args.generation), filters=args.filter)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify_checkpoint(args.path, role=args.role, generation=args.generation,
                               progress=progress_for(quiet=args.quiet), decode=args.decode)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for problem in report.problems:
            print(f"PROBLEM {problem.entry or '(file)'}: {problem.message}")
        verdict = "OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)"
        checked = human_bytes(report.bytes_checked)
        if report.raw_bytes != report.bytes_checked:  # compressed chunks, checked as stored
            checked = f"{checked} stored ({human_bytes(report.raw_bytes)} raw)"
        print(f"{verdict}: {report.path} generation {report.generation}: {report.tensors} tensors and "
              f"{report.values} values intact, {checked} checked")
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    result = export_safetensors(
        args.path, args.out, component=args.component, role=args.role, max_shard_size=args.max_shard_size,
        rules=_rules(args), casts=CastRules(tuple(args.dtype)), config=args.config, keep_tied=args.keep_tied,
        overwrite=args.overwrite, progress=progress_for(quiet=args.quiet))
    print(f"exported {result.tensors} tensors ({human_bytes(result.total_bytes)}) into {len(result.files)} "
          f"file(s) in {result.out}")
    for name, kept in result.tied.items():
        print(f"  tied: {name} is written once, as {kept}")
    if result.skipped_values:
        print(f"  not exported (non-tensor values): {', '.join(result.skipped_values)}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    source = args.source_format if args.source_format != "auto" else ("bcp" if args.role else _detect(args.src))
    target = args.target_format or ("dcp" if source == "bcp" else "bcp")
    if (source, target) not in {("dcp", "bcp"), ("hf", "bcp"), ("bcp", "dcp")}:
        raise CheckpointError(f"converting {source} to {target} is not supported (supported: dcp->bcp, hf->bcp, "
                              "bcp->dcp; for safetensors, use bcp export)")
    if source == "bcp":
        result = convert_bcp_to_dcp(args.src, args.out, role=args.role, allow_pickle=args.trust_pickle,
                                    progress=progress_for(quiet=args.quiet))
        print(f"wrote DCP checkpoint {result.out}: {result.tensors} tensors, {result.values} values")
        if result.reduced_to_rank0:
            print(f"  per-rank values kept as rank 0 saved them: {', '.join(result.reduced_to_rank0)}")
    elif source == "dcp":
        result = convert_dcp_to_bcp(args.src, args.out, trust_pickle=args.trust_pickle, rules=_rules(args),
                                    casts=CastRules(tuple(args.dtype)), compression=args.compress,
                                    progress=progress_for(quiet=args.quiet))
        print(f"wrote bcp checkpoint {result.out}: {result.tensors} tensors, {result.values} values")
    else:
        ties = None if args.tie is None else dict(args.tie)
        result = convert_hf_to_bcp(args.src, args.out, component=args.component, rules=_rules(args),
                                   casts=CastRules(tuple(args.dtype)), ties=ties, compression=args.compress,
                                   progress=progress_for(quiet=args.quiet))
        print(f"wrote bcp checkpoint {result.out}: {result.tensors} tensors")
        for alias, name in result.tied.items():
            print(f"  tied: {alias} shares the tensor of {name}")
    return 0


def _edit(args: argparse.Namespace) -> int:
    result = edit_checkpoint(args.src, args.out, role=args.role, rules=_rules(args),
                             casts=CastRules(tuple(args.dtype)), consolidate=args.consolidate,
                             compression=args.compress, progress=progress_for(quiet=args.quiet))
    print(f"wrote {result.out}: {result.tensors} tensors, {result.values} values, {result.dropped} dropped")
    return 0


def _copy(args: argparse.Namespace) -> int:
    result = copy_checkpoint(args.src, args.out, role=args.role, generation=args.generation,
                             compression=args.compress, progress=progress_for(quiet=args.quiet))
    print(f"copied {result.tensors} tensors and {result.values} values into {result.out} (refers to nothing "
          "outside it)")
    return 0


def _report(args: argparse.Namespace) -> int:
    source = os.path.join(args.path, args.role) if args.role else args.path
    summary = report(source, index=args.index, op=args.op, phase=args.phase, heatmap=args.heatmap, trace=args.trace,
                     gantt=args.gantt, ranks=args.ranks, straggler_seconds=args.straggler_seconds,
                     straggler_ratio=args.straggler_ratio)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format())
    for what, written in (("heat map", args.heatmap), ("Gantt chart", args.gantt), ("trace", args.trace)):
        if written and not args.json:
            print(f"  {what}: {written}")
    return 0


def _detect(src: str) -> str:
    if is_url(src):  # DCP folders and safetensors files are read from local paths only
        return "bcp"
    if os.path.isfile(os.path.join(src, ".metadata")):
        return "dcp"
    if os.path.isdir(src) and any(n.startswith("gen-") for n in os.listdir(src)):
        return "bcp"
    if src.endswith(".safetensors") or (os.path.isdir(src) and any(n.endswith(".safetensors")
                                                                     for n in os.listdir(src))):
        return "hf"
    if not os.path.exists(src):
        raise CheckpointError("no such file or folder", path=src)
    raise CheckpointError("cannot tell the format (bcp, dcp or hf safetensors); pass --from", path=src)


def _rules(args: argparse.Namespace) -> NameRules:
    try:
        return NameRules(drop=tuple(args.drop), rename=tuple(tuple(r) for r in args.rename))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _tie(text: str) -> tuple[str, str]:
    alias, sep, key = text.partition("=")
    if not (sep and alias and key):
        raise argparse.ArgumentTypeError(f"expected ALIAS=KEY, got {text!r}")
    return alias, key


def _ranks(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0,3,7, got {text!r}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cast(text: str) -> tuple[str | None, Any]:
    try:
        return CastRules.parse_rule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
