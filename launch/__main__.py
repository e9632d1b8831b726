"""`python -m launch --config FILE [options] [section.field=value ...]`: run this node's part of an mpo run.

Under SLURM (one agent per node: `srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m launch ...`) the nodes,
this node's rank, the GPUs per node and the job id come from the SLURM environment. Outside SLURM pass `--hosts`
and `--node-rank` (and start one agent per node yourself), or nothing for a single local node.
`--dry-run` prints every node's exact commands and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from launch.plan import Allocation, LaunchOptions, PlanError, make_plan


def slurm_hosts(nodelist: str) -> tuple[str, ...]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return tuple(out.stdout.split())


def _int_prefix(text: str | None) -> int | None:
    """SLURM_GPUS_PER_NODE may read "8", "h100:8" or "8(x4)"."""
    if not text:
        return None
    digits = text.rsplit(":", 1)[-1].split("(")[0]
    return int(digits) if digits.isdigit() else None


def allocation_from_env(args: argparse.Namespace, env: dict[str, str]) -> tuple[Allocation, int | None]:
    """(allocation, this node's rank or None) from the arguments, else SLURM, else one local node."""
    in_slurm = "SLURM_JOB_NODELIST" in env and not args.hosts
    if args.hosts:
        hosts = tuple(h for h in args.hosts.split(",") if h)
    elif in_slurm:
        hosts = slurm_hosts(env["SLURM_JOB_NODELIST"])
    else:
        hosts = ("127.0.0.1",)
    gpus = args.gpus_per_node
    if gpus is None and in_slurm:
        gpus = _int_prefix(env.get("SLURM_GPUS_ON_NODE")) or _int_prefix(env.get("SLURM_GPUS_PER_NODE"))
    node_rank = args.node_rank
    if node_rank is None and in_slurm and "SLURM_NODEID" in env:
        node_rank = int(env["SLURM_NODEID"])
    if node_rank is None and len(hosts) == 1:
        node_rank = 0
    job_id = args.job_id
    if job_id is None:
        job_id = (f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}" if in_slurm and "SLURM_JOB_ID" in env
                  else "local")
    return Allocation(hosts=hosts, gpus_per_node=gpus or 0, job_id=job_id), node_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="mpo YAML config")
    parser.add_argument("--hosts", default=None, help="comma-separated node addresses (default: SLURM, else local)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index in --hosts (default: "
                        "SLURM_NODEID)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: SLURM_GPUS_ON_NODE, else 0 (CPU)")
    parser.add_argument("--trainer-nodes", type=int, default=None, help="nodes running trainer ranks (default: "
                        "world_size / gpus_per_node on GPU, all nodes on CPU)")
    parser.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    parser.add_argument("--engine-python", default=os.environ.get("MPO_ENGINE_PYTHON"),
                        help="interpreter for the engines (default: $MPO_ENGINE_PYTHON, else --python)")
    parser.add_argument("--job-id", default=None, help="run id (default: SLURM_JOB_ID.SLURM_STEP_ID, else 'local')")
    parser.add_argument("--master-port", type=int, default=None)
    parser.add_argument("--engine-port", type=int, default=None, help="first engine port")
    parser.add_argument("--engine-mem-fraction", type=float, default=None, help="SGLang --mem-fraction-static")
    parser.add_argument("--engine-timeout", type=float, default=1800.0, help="seconds to wait for engines")
    parser.add_argument("--dry-run", action="store_true", help="print every node's commands and exit")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)

    from mpo.config import ConfigError
    from mpo.config_checks import load_config
    from mpo.model_import import refuse_without_weights

    overrides = list(args.overrides)
    try:
        config = load_config(args.config, overrides)
        # The sbatch script makes one key per job and exports it to every agent; it then reaches the engines
        # (environment variable MPO_API_KEY, never argv) and the trainer (the resolved config, mode 0600).
        key = os.environ.get("MPO_ENGINE_API_KEY")
        if key and not config.rollout.api_key and not config.rollout.urls:
            overrides.append(f"rollout.api_key={key}")
            config = load_config(args.config, overrides)
        refuse_without_weights(config, where="the launched run")  # conversion is one job before the nodes start
        allocation, node_rank = allocation_from_env(args, dict(os.environ))
        options = LaunchOptions(config_path=args.config, overrides=tuple(overrides), python=args.python,
                                engine_python=args.engine_python,
                                trainer_nodes=args.trainer_nodes, master_port=args.master_port,
                                engine_port=args.engine_port, engine_mem_fraction=args.engine_mem_fraction)
        plan = make_plan(config, allocation, options)
    except (ConfigError, PlanError) as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from mpo.memory_plan import sync_shape

        print(plan.format())
        print(sync_shape(config).format(), file=sys.stderr)  # stdout stays the commands, exactly
        return 0
    if config.rollout.engine == "sglang" and not config.rollout.urls and config.sync.transport == "distributed":
        from mpo.prestart import check_one_nccl

        try:  # before any group is formed: the trainer's and the engines' interpreters on this node, one NCCL
            check_one_nccl(args.python, args.engine_python or args.python)
        except ConfigError as exc:
            print(f"launch: error: {exc}", file=sys.stderr)
            return 2
    if node_rank is None or not 0 <= node_rank < len(plan.nodes):
        print(f"launch: error: this node's rank is unknown or out of range ({node_rank}); pass --node-rank",
              file=sys.stderr)
        return 2
    from launch.agent import Agent

    return Agent(plan, node_rank, engine_timeout_s=args.engine_timeout).run()


if __name__ == "__main__":
    sys.exit(main())
