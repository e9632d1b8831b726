"""`python -m mpo.engine`: serve the mpo model behind SGLang's HTTP API (CPU rollouts, tests, demo)."""

from __future__ import annotations

import sys

from mpo.lifecycle import exit_with_parent, freeze_startup_heap

if __name__ == "__main__" and "--exit-with-parent" in sys.argv:
    exit_with_parent(signal_by_default=False)  # before torch and the model load: a starter dying mid-load ends us

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from mpo.parallel.device import skip_torch_compile_without_gpu
from mpo.rollout.engine_command import API_KEY_ENV
from mpo.engine.server import DEFAULT_MAX_ROWS, ServerLimits


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite value > 0")
        return value

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mpo.engine", description=__doc__)
    parser.add_argument("--preset", default="tiny", help="model preset (mpo.models.config.PRESETS)")
    parser.add_argument("--mcore-dir", default=None, help="torch_dist checkpoint to load (default: seeded init)")
    parser.add_argument("--model-path", default=None,
                        help="a Hugging Face directory to serve (config.json + safetensors), as SGLang's --model-path; "
                             "overrides --preset and --mcore-dir")
    parser.add_argument("--seed", type=int, default=1234, help="init seed when no checkpoint is given")
    parser.add_argument("--await-weights", action="store_true",
                        help="start from transformers' random init instead of the trainer's (--seed / --mcore-dir): "
                             "the weights arrive by a weight sync before any request (mpo's runs publish first); "
                             "megatron-core is then not imported. --model-path still loads its checkpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key-file", default=None,
                        help=f"file holding the bearer token clients must send (default: ${API_KEY_ENV}; never on "
                             f"argv, where `ps` shows it to every user)")
    parser.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused with a message, see main()
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--fp32-lm-head", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--dist-port", type=int, default=None, help="port of this engine's own 1-rank gloo group")
    parser.add_argument("--max-body-mb", type=_positive(float), default=ServerLimits.max_body_bytes / (1 << 20),
                        help="largest request body in MiB, 413 beyond; must exceed 4/3 x the weight bucket size "
                             "(base64) for /update_weights_from_tensor")
    parser.add_argument("--idle-timeout-s", type=_positive(float), default=ServerLimits.idle_timeout_s,
                        help="close a kept-alive connection idle this long between requests")
    parser.add_argument("--header-timeout-s", type=_positive(float), default=ServerLimits.header_timeout_s,
                        help="a request's line and headers must arrive whole within this long (408 and closed "
                             "otherwise); until then a new connection holds no slot")
    parser.add_argument("--body-timeout-s", type=_positive(float), default=ServerLimits.body_timeout_s,
                        help="a request body must arrive within this long plus 1 s per --min-body-mb-per-s MiB, and "
                             "never fall further behind; the connection is closed otherwise")
    parser.add_argument("--min-body-mb-per-s", type=_positive(float),
                        default=ServerLimits.min_body_bytes_per_s / (1 << 20),
                        help="slowest body upload (MiB/s) allowed past --body-timeout-s")
    parser.add_argument("--max-connections", type=_positive(int), default=ServerLimits.max_connections,
                        help="connections served at once (one thread each); 503 beyond; also the listen backlog")
    parser.add_argument("--max-rows-per-request", type=_positive(int), default=DEFAULT_MAX_ROWS,
                        help="rows of one batched /generate; 400 beyond")
    parser.add_argument("--group-init-timeout-s", type=_positive(float), default=60.0,
                        help="bound on /init_weights_update_group (rendezvous and group creation each)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the process that started this engine dies (set by mpo's launchers)")
    return parser.parse_args(argv)


def api_key(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """The engine's key: --api-key-file's contents, else $MPO_API_KEY, else None (no auth). Raises ValueError with
    one line for a key given on argv or an unreadable file."""
    if args.api_key is not None:
        raise ValueError(f"--api-key is refused: the command line is visible to every user (ps); set {API_KEY_ENV} "
                         f"or pass --api-key-file PATH")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return env.get(API_KEY_ENV) or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        key = api_key(args, dict(os.environ))
    except ValueError as exc:
        print(f"mpo engine: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s mpo-engine %(levelname)s %(message)s")
    torch.set_num_threads(1)
    skip_torch_compile_without_gpu()
    from mpo.engine.model import EngineModel
    from mpo.engine.server import EngineApp, serve
    from mpo.engine.weight_routes import WeightRoutes
    from mpo.engine.generator import MpoGenerator

    runner = EngineModel.create(preset=args.preset, mcore_dir=args.mcore_dir, seed=args.seed, dtype=args.dtype,
                                fp32_lm_head=args.fp32_lm_head, dist_port=args.dist_port, hf_dir=args.model_path,
                                await_weights=args.await_weights)
    generator = MpoGenerator(runner, vocab_size=runner.vocab_size, max_batch=args.max_batch,
                             num_experts=runner.model_cfg.num_experts)
    app = EngineApp(generator, info={
        "engine": "mpo", "model_path": args.model_path or args.mcore_dir or f"preset:{args.preset}",
        "enable_return_routed_experts": args.enable_return_routed_experts,
        "num_layers": runner.model_cfg.num_layers, "topk": runner.model_cfg.router_topk,
        "vocab_size": runner.vocab_size, "dtype": args.dtype, "fp32_lm_head": args.fp32_lm_head,
        "context_length": runner.model_cfg.max_position_embeddings,
        "tp_size": 1,  # one weight-update rank (SGLang reports its --tp here)
    }, max_rows=args.max_rows_per_request)
    # SGLang's weight-update endpoints: tensor, distributed and disk paths
    WeightRoutes(runner, app, group_init_timeout_s=args.group_init_timeout_s).install()
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), idle_timeout_s=args.idle_timeout_s,
                          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                          min_body_bytes_per_s=args.min_body_mb_per_s * (1 << 20), max_connections=args.max_connections,
                          listen_backlog=max(args.max_connections, 128))
    freeze_startup_heap()  # the model and its weights: out of every collection while serving
    server = serve(app, args.host, args.port, key, limits)
    logging.info("mpo engine serving on http://%s:%d", args.host, args.port)
    if not key:  # mpo's own runs always give their engines a key (mpo.rollout.engines)
        logging.warning("no API key (%s or --api-key-file): every user of this host can call this engine, "
                        "including its weight-update and memory routes", API_KEY_ENV)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # An engine started by a trainer rank or a test lives in its own session; if that parent dies (killed job), the
    # engine is re-parented and stops itself, so nothing is left running.
    parent = os.getppid()
    while not stop.wait(1.0):
        if args.exit_with_parent and os.getppid() != parent:
            logging.warning("parent process %d is gone; stopping", parent)
            break
    generator.stop()
    server.shutdown()
    # Nothing is left to flush but the log: skip the interpreter's teardown of torch and megatron (1-2 s per stop).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
