"""The `mpo` command: `mpo train`, `mpo demo`, `mpo bench`, `mpo check-config`, `mpo plan` (mpo.memory_plan),
`mpo export`, `mpo plot` (mpo.trainer.plot; `mpo train` writes the plot after a successful run).

`mpo train --config FILE [section.field=value ...]` validates the whole config first (a bad field fails here, before
any process starts, with one line naming it), then starts the trainer ranks of this node with torchrun. Multi-node
jobs go through `python -m launch` (see slurm/), which starts the same trainer module on every node.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from mpo.config import RECIPES
from mpo.lifecycle import NoSpaceLeft, RunDirInUse, child_env, lock_run_dir, writing

INTERRUPTED_EXIT = 130  # a shell's status for a process stopped by Ctrl-C


def resolve_config(config_path: str | None, overrides: list[str]):
    """Load and validate; returns (TrainConfig, the resolved YAML text every rank will read)."""
    import yaml

    from mpo.config import to_dict
    from mpo.config_checks import load_config

    config = load_config(config_path, overrides)
    return config, yaml.safe_dump(to_dict(config), sort_keys=False)


def run_local(config_path: str | None, overrides: list[str], *, plot: bool = True) -> int:
    """Validate, write the resolved config into the run directory, start world_size ranks here with torchrun; after a
    successful run, write RUN/metrics.png (`plot`; the demo writes its own)."""
    import yaml

    from mpo.config import to_dict
    from mpo.config_checks import load_config
    from mpo.memory_plan import check_fits_here

    config = load_config(config_path, overrides)  # its YAML is written once conversion has settled model.mcore_dir
    check_fits_here(config)  # before any rank tries to build a model this machine cannot hold
    out_dir = Path(config.logging.out_dir)
    lock = lock_run_dir(out_dir)  # held until torchrun returns; first, so a refused run writes nothing here
    try:
        from mpo.model_import import ensure_converted

        config = ensure_converted(config)  # model.hf_dir alone: its weights, converted once (never random ones)
        from mpo.prestart import before_start

        before_start(config)  # files and engines a rank would trip on, in one line each
        resolved = out_dir / "config.yaml"
        with writing(resolved):
            resolved.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))  # what every rank reads
        # mpo.torchrun: torchrun that dies with this process, its ranks with it, and reports a full disk in one line.
        # --standalone: torchrun's store binds a port the OS picks (port 0) and the ranks rendezvous on that store. A
        # port picked here and bound a few seconds later, after torchrun's imports, could be taken meanwhile by
        # another process on a busy host (seen with SGLang's port under two pytest workers), failing the run.
        command = [sys.executable, "-m", "mpo.torchrun", "--standalone", f"--nproc_per_node={config.world_size}",
                   "-m", "mpo.trainer", "--config", str(resolved)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"), **child_env()}
        # The ranks import torch and megatron before their first line (~10 s): say what is starting meanwhile. No "mpo:"
        # prefix: that one marks the one line a failure ends with.
        print(f"starting {config.world_size} trainer rank{'s' * (config.world_size > 1)} (torchrun); run directory "
              f"{out_dir}", file=sys.stderr, flush=True)
        code = _run_ranks(command, env, out_dir)
        if code == 0 and plot:
            try:
                write_run_plot(out_dir)
            except (OSError, ImportError) as exc:  # the run succeeded and is intact: a missing plot is no failure
                print(f"mpo: plot not written ({exc}); `mpo plot {out_dir}` retries", file=sys.stderr)
        return code
    finally:
        lock.close()


def _run_ranks(command: list[str], env: dict[str, str], out_dir: Path) -> int:
    """torchrun's exit status. Ctrl-C reaches this process and torchrun (one process group; torchrun forwards it to
    the ranks): subprocess.call then kills torchrun, whose ranks and engines die with it (mpo.lifecycle), and the
    run's checkpoints are atomic; instead of every process's traceback, one line says where the run stands."""
    try:
        code = subprocess.call(command, env=env)
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT
    if code not in (INTERRUPTED_EXIT, -signal.SIGINT):  # mpo.torchrun exits 130 when it was interrupted itself
        return code
    from mpo.model_files import CheckpointError, latest_checkpoint

    try:  # what a rerun resumes from, read as the resume reads it
        latest = latest_checkpoint(out_dir / "checkpoints")
    except CheckpointError:
        latest = None
    where = f"its last checkpoint is {latest}" if latest is not None else "no checkpoint had been written yet"
    print(f"mpo: interrupted; {where}: rerun the same command to resume", file=sys.stderr)
    return INTERRUPTED_EXIT


def write_run_plot(out_dir: Path) -> int:
    """RUN/metrics.png from RUN/metrics.jsonl (mpo.trainer.plot), said in one line; 1 when the run has no RL step
    yet."""
    from mpo.trainer.plot import write_plot

    path = write_plot(out_dir)
    if path is None:
        print(f"mpo: {out_dir / 'metrics.jsonl'} holds no RL step yet: no plot written", file=sys.stderr)
        return 1
    print(f"plot: {path}", file=sys.stderr)
    return 0


def memory_plan(config, *, gpu_mem_gib: float, seq_len: int | None = None,
                engine_mem_fraction: float | None = None, gpus_per_node: int = 8, out=None) -> int:
    """Print the memory plan (mpo.memory_plan) and the GPUs it takes; 0 when every role fits (a tight one is said on
    stderr), 2 when one does not."""
    from mpo.config import ConfigError
    from mpo.memory_plan import PlanInputs, format_plan, gpu_totals, longest_trainer_row, plan_memory, sync_shape

    for name, value, ok in (("--gpu-mem-gib", gpu_mem_gib, gpu_mem_gib > 0), ("--seq-len", seq_len,
                            seq_len is None or seq_len > 0), ("--gpus-per-node", gpus_per_node, gpus_per_node > 0),
                            ("--engine-mem-fraction", engine_mem_fraction,
                             engine_mem_fraction is None or 0 < engine_mem_fraction <= 1)):
        if not ok:
            raise ConfigError(f"{name}={value}; valid values: > 0{' and <= 1' if 'fraction' in name else ''}")
    roles = plan_memory(config, PlanInputs(gpu_mem_gib=gpu_mem_gib, seq_len=seq_len,
                                           engine_mem_fraction=engine_mem_fraction))
    print(format_plan(roles), file=out or sys.stdout)
    longest = longest_trainer_row(config, PlanInputs(gpu_mem_gib=gpu_mem_gib))
    print(f"longest training row that fits the trainer: {longest:,} tokens", file=out or sys.stdout)
    print(sync_shape(config).format(), file=out or sys.stdout)
    print(gpu_totals(config, gpus_per_node), file=out or sys.stdout)  # last: what the run takes
    misfits = [role.role for role in roles if not role.fits]
    if misfits:
        print(f"mpo: memory plan: {', '.join(misfits)} does not fit in {gpu_mem_gib:g} GiB", file=sys.stderr)
        return 2
    tight = [role.role for role in roles if role.tight]
    if tight:
        print(f"mpo: memory plan: {', '.join(tight)} is tight in {gpu_mem_gib:g} GiB (under 5% free): expect "
              "out-of-memory errors from fragmentation; lower schedule.micro_batch_size or raise a parallel size",
              file=sys.stderr)
    return 0


def _gpu_memory_args(parser: argparse.ArgumentParser) -> None:
    from mpo.memory_plan import H100_GIB

    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpu-mem-gib", type=float, default=None,
                       help=f"memory of one GPU in GiB, nvidia-smi's total / 1024 (default {H100_GIB}: an 80 GB "
                            "H100; an H200 is 139.8)")
    group.add_argument("--gpu-mem-gb", type=float, default=None,
                       help="the same in GB (10^9 bytes), converted to GiB")


def _gpu_mem_gib(args: argparse.Namespace) -> float:
    from mpo.memory_plan import GIB, H100_GIB

    if args.gpu_mem_gb is not None:
        return args.gpu_mem_gb * 1e9 / GIB
    return H100_GIB if args.gpu_mem_gib is None else args.gpu_mem_gib


def summarize_demo(out_dir: Path) -> str:
    """Reward before/after table and a PNG of reward, loss and routing agreement over steps (mpo.trainer.plot)."""
    from mpo.trainer.plot import before_after, write_plot

    table = before_after(out_dir)
    plot = write_plot(out_dir, out_dir / "demo.png")
    if plot is None:
        return table
    return f"{table}\nplot: {plot}   metrics: {out_dir / 'metrics.jsonl'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpo", description="RL for Mixture-of-Experts LLMs on megatron-core + SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job on this node (validates the config first)")
    train.add_argument("--config", required=True)
    train.add_argument("overrides", nargs="*", help="section.field=value")
    check = sub.add_parser("check-config", help="validate a config and print it resolved (GPU configs: and its "
                           "memory plan, on stderr; exit 2 when a GPU role does not fit)")
    check.add_argument("--config", required=True)
    _gpu_memory_args(check)
    check.add_argument("overrides", nargs="*")
    plan = sub.add_parser("plan", help="per GPU role: bytes of parameters, gradients, optimizer state, activations, "
                          "engine weights and KV cache; exit 2 when a role does not fit")
    plan.add_argument("--config", required=True)
    _gpu_memory_args(plan)
    plan.add_argument("--gpus-per-node", type=int, default=8, help="for the GPU and node totals (default 8)")
    plan.add_argument("--seq-len", type=int, default=None,
                      help="tokens per training row (default: rollout.max_new_tokens + 1024 prompt tokens)")
    plan.add_argument("--engine-mem-fraction", type=float, default=None,
                      help="SGLang --mem-fraction-static (default 0.85)")
    plan.add_argument("overrides", nargs="*")
    demo = sub.add_parser("demo", help="tiny MoE learns a toy task with RL on CPU (a gloo rank and mpo's engine)")
    demo.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    demo.add_argument("--out", default="runs/demo", help="run directory (a rerun resumes from its checkpoint)")
    demo.add_argument("--loss", default=None, help="policy loss: grpo (default), gspo, sapo, rspo, ...")
    demo.add_argument("--replay", default=None, choices=("none", "r2", "r3"), help="routing replay mode")
    demo.add_argument("overrides", nargs="*", help="section.field=value")
    sub.add_parser("bench", help="mpo bench NAME [args] (same as python -m mpo.bench)", add_help=False)
    from mpo import export  # `mpo export RUN [--step N] --out DIR` (mpo.export)

    export.add_parser(sub)
    plot_cmd = sub.add_parser("plot", help="write RUN/metrics.png (reward, held-out evaluation, loss, routing "
                              "agreement over RL steps) from RUN/metrics.jsonl; a running run can be plotted too")
    plot_cmd.add_argument("run", help="run directory (logging.out_dir)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "export" and not rest:
        return export.main(args)

    from mpo.config import ConfigError

    try:
        if args.command == "bench":
            from mpo.bench.__main__ import main as bench_main

            return bench_main(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "check-config":
            config, text = resolve_config(args.config, args.overrides)
            cpu_run = config.rollout.engine != "sglang"  # the GPU plan does not apply, this host's memory does
            if cpu_run:
                from mpo.memory_plan import check_fits_here

                check_fits_here(config)
            print(text, end="")
            return 0 if cpu_run else memory_plan(config, gpu_mem_gib=_gpu_mem_gib(args), out=sys.stderr)
        if args.command == "plan":
            config, _ = resolve_config(args.config, args.overrides)
            return memory_plan(config, gpu_mem_gib=_gpu_mem_gib(args), seq_len=args.seq_len,
                               engine_mem_fraction=args.engine_mem_fraction, gpus_per_node=args.gpus_per_node)
        if args.command == "train":
            return run_local(args.config, args.overrides)
        if args.command == "plot":
            if not (Path(args.run) / "metrics.jsonl").is_file():
                print(f"mpo: {Path(args.run) / 'metrics.jsonl'} does not exist: give the run directory "
                      f"(logging.out_dir) of a run", file=sys.stderr)
                return 2
            return write_run_plot(Path(args.run))
        # The demo evaluates held-out reversals every 20 steps (eval.every=0 turns it off).
        overrides = ["eval.every=20", f"logging.out_dir={args.out}", *args.overrides]
        if args.steps is not None:
            overrides.append(f"schedule.steps={args.steps}")
        if args.loss:
            overrides.append(f"algorithm.loss={args.loss}")
        if args.replay:
            overrides.append(f"algorithm.replay={args.replay}")
        code = run_local(str(RECIPES / "demo_cpu.yaml"), overrides, plot=False)
        if code == 0:  # a failed run has said why in one line; its plot could not be written to a full disk anyway
            print(summarize_demo(Path(args.out)))
        return code
    except ConfigError as exc:
        print(f"mpo: config error: {exc}", file=sys.stderr)
        return 2
    except (RunDirInUse, NoSpaceLeft) as exc:
        print(f"mpo: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. logging.out_dir is read-only or a file: the environment, one line
        print(f"mpo: error: {exc.strerror or exc}{f' | file={exc.filename}' if exc.filename else ''}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
