"""Command line: python -m checkpoints_tools {hf-to-mcore, mcore-to-hf, verify}.

Exit status: 0 success (verify: within tolerance); 1 verify ran and is out of tolerance; 2 bad input (missing or
corrupt file, unsupported model, bad layout, unwritable or locked output: one line on stderr); 3 internal error
(a bug: traceback on stderr).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

from mpo.models.hf_source import ConversionError

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


EXIT_OUT_OF_TOLERANCE, EXIT_BAD_INPUT, EXIT_INTERNAL_ERROR = 1, 2, 3


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (`--help` shows the usage), exit status 2 like every other bad input."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m checkpoints_tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> megatron-core torch_dist")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--out-dir", required=True)
    to_mcore.add_argument("--spec", choices=("both", "local", "te"), default="both",
                          help="layer-spec key names to write: both (default; loads with the CPU local spec and "
                               "the GPU Transformer Engine spec), local, te")
    to_mcore.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                          help="stored dtype (default: the source's; FP8 sources become bf16)")
    to_mcore.add_argument("--no-progress", action="store_true")

    to_hf = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist -> HF safetensors shards + index")
    to_hf.add_argument("--mcore-dir", required=True)
    to_hf.add_argument("--out-dir", required=True)
    to_hf.add_argument("--hf-config", default=None, help="config.json to use (default: the one hf-to-mcore kept)")
    to_hf.add_argument("--max-shard-gb", type=_positive_float, default=2.0)
    to_hf.add_argument("--no-progress", action="store_true")

    check = sub.add_parser("verify", help="compare HF (transformers) and megatron (mpo) outputs on prompts")
    check.add_argument("--hf-dir", required=True)
    check.add_argument("--mcore-dir", required=True)
    check.add_argument("--tp", type=_positive_int, default=1)
    check.add_argument("--ep", type=_positive_int, default=1)
    check.add_argument("--pp", type=_positive_int, default=1)
    check.add_argument("--etp", type=_positive_int, default=None)
    check.add_argument("--pp-first", type=_positive_int, default=None,
                       help="layers of the first pipeline stage (uneven stages, e.g. 61 layers at --pp 8: 5)")
    check.add_argument("--pp-last", type=_positive_int, default=None, help="layers of the last pipeline stage")
    check.add_argument("--vpp", type=_positive_int, default=None, help="virtual pipeline stages per stage")
    check.add_argument("--tolerance", type=_positive_float, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "verify":
            from checkpoints_tools.verify import DEFAULT_TOLERANCE, verify

            report = verify(args.hf_dir, args.mcore_dir, tp=args.tp, ep=args.ep, pp=args.pp, etp=args.etp,
                            pp_first=args.pp_first, pp_last=args.pp_last, vpp=args.vpp,
                            tolerance=args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE)
            print("\n".join(report.lines()))
            return 0 if report.passed else EXIT_OUT_OF_TOLERANCE
        if args.command == "hf-to-mcore":
            import torch

            from checkpoints_tools.convert import hf_to_mcore

            dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
            report = hf_to_mcore(args.hf_dir, args.out_dir, spec=args.spec, dtype=dtype,
                                 show_progress=not args.no_progress)
        else:
            from checkpoints_tools.convert import mcore_to_hf

            report = mcore_to_hf(args.mcore_dir, args.out_dir, hf_config=args.hf_config,
                                 max_shard_bytes=int(args.max_shard_gb * 2**30), show_progress=not args.no_progress)
        print(f"{args.command}: {report.architecture}, {report.tensors} HF tensors, {report.bytes / 2**20:.1f} MiB "
              f"in {report.seconds:.1f}s -> {args.out_dir}")
        return 0
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the environment, not the code: disk full, permissions, a path that is a file
        where = f" | file={exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:  # a bug: keep the traceback, and an exit status no input error or verify result uses
        traceback.print_exc()
        return EXIT_INTERNAL_ERROR
