"""The plan of a run: which processes run on which node, with which command line and environment.

`make_plan(config, allocation, options)` is a pure function (no processes, no network, no file writes), so every
agent of a job computes the same plan from the same inputs, and tests can compare it with an expected one.

Placement (see launch/README.md):
- Trainer: `config.world_size` ranks. On GPU nodes a node runs `gpus_per_node` ranks, so the trainer takes the first
  `world_size / gpus_per_node` nodes (a world smaller than one node takes one node). On CPU (gpus_per_node == 0) the
  ranks are spread evenly over all nodes unless `trainer_nodes` says otherwise.
- Rollout engines (only when `rollout.urls` is empty; given URLs are used as they are):
  - disaggregated: the nodes after the trainer's run engines; an SGLang engine takes `rollout.tensor_parallel` GPUs,
    so a rollout node holds `gpus_per_node // tensor_parallel` of them. Engines fill rollout nodes in order.
  - colocated (no node is left for rollout): engines share the trainer's nodes, filled from the last node backwards
    so that node 0 (rank 0 also runs the engines' weight-update sessions and its stage's sync sender) carries the
    fewest.
- Rendezvous: torchrun static rendezvous on the first trainer node (`--node-rank` = trainer node index), so global
  rank 0 is always on trainer node 0 (c10d rendezvous may hand group 0 to any node).
- Ports are derived from the job id, so two jobs sharing a node do not collide and every agent agrees on them
  without talking to the others. Engines get distinct ports even on different nodes (nodes may share one host in
  emulated clusters, and it costs nothing on real ones).
"""

from __future__ import annotations

import shlex
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from mpo.config import TrainConfig
from mpo.rollout.engine_command import REDACTED, SECRET_ENV, EngineSettings, engine_command
from mpo.weight_sync.relay import NODE_HOST_ENV
from mpo.weight_sync.transports import check_transport, same_host, transport_class
from mpo.weight_sync.wire import group_layout


class PlanError(ValueError):
    """The config cannot be placed on this allocation (message says why and what to change)."""


@dataclass(frozen=True)
class Allocation:
    """The nodes of a job.

    Attributes:
        hosts: node addresses in node-rank order (SLURM: `scontrol show hostnames $SLURM_JOB_NODELIST`); trainer
            rendezvous and engine URLs use them, so they must resolve on every node.
        gpus_per_node: GPUs each node has (0: CPU nodes; gloo and mpo's own engine).
        job_id: identifies the run (SLURM_JOB_ID); ports and the run's launch directory derive from it.
    """

    hosts: tuple[str, ...]
    gpus_per_node: int = 0
    job_id: str = "local"


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond the config.

    Attributes:
        config_path: the YAML given to the launcher.
        overrides: `section.field=value` overrides given to the launcher (applied before the launcher's own).
        python: interpreter on the nodes for the trainer (a venv's python, or `python` inside a container).
        engine_python: interpreter for the engines (SGLang often lives in its own venv); None = `python`.
        trainer_nodes: nodes that run trainer ranks; None = automatic (see the module docstring).
        master_port: torchrun rendezvous port; None = derived from the job id.
        engine_port: first engine port; None = derived from the job id.
        engine_mem_fraction: SGLang --mem-fraction-static; None = SGLang's default when disaggregated, 0.4 colocated.
    """

    config_path: str
    overrides: tuple[str, ...] = ()
    python: str = "python"
    engine_python: str | None = None
    trainer_nodes: int | None = None
    master_port: int | None = None
    engine_port: int | None = None
    engine_mem_fraction: float | None = None


@dataclass(frozen=True)
class Process:
    """One process the agent of a node starts.

    Attributes:
        name: "trainer" or "engine<i>"; messages and the log file use it.
        kind: "trainer" or "engine".
        argv: the exact command line.
        env: variables set on top of the agent's environment (an engine's key is one: MPO_API_KEY, never argv).
        log: log file (stdout and stderr).
        url: for engines, the URL the trainer uses.
    """

    name: str
    kind: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    log: str = ""
    url: str | None = None

    def shell(self) -> str:
        """The command as one shell line (env assignments first), for --dry-run and messages."""
        prefix = " ".join(f"{k}={REDACTED if k in SECRET_ENV else shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class NodePlan:
    """What one node runs. `role` is "trainer", "rollout", "trainer+rollout" or "idle"."""

    node_rank: int
    host: str
    role: str
    processes: tuple[Process, ...]
    log_dir: str


@dataclass(frozen=True)
class WeightSyncGroup:
    """The process group `sync.transport: distributed` makes, as this plan places it (mpo.weight_sync).

    Attributes:
        master_address: where every engine reaches trainer global rank 0, which hosts the group's rendezvous:
            trainer node 0's host (the trainer gets it as sync.master_address). The port is picked free by
            rank 0 when it makes the group and sent to the engines with /init_weights_update_group.
        world_size: 1 (trainer rank 0) + every engine's TP ranks.
        rank_offsets: engine i's first rank (its TP ranks are rank_offsets[i] .. + tp_sizes[i] - 1).
        tp_sizes: ranks per engine (SGLang's --tp; 1 for mpo's engine).
    """

    master_address: str
    world_size: int
    rank_offsets: tuple[int, ...]
    tp_sizes: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The whole run.

    Attributes:
        nodes: one NodePlan per allocated node, in node-rank order.
        placement: "colocated" or "disaggregated" (engines on their own nodes), or "external" (rollout.urls given).
        engine_urls: URLs the trainer is handed (rollout.urls).
        trainer_overrides: overrides the launcher adds for the trainer (engine URLs).
        resolved_config: the YAML every trainer rank reads (the launcher's config, overrides, and trainer_overrides).
        resolved_config_path: where the agent writes it before starting the trainer (mode 0600: it may hold the key).
        run_dir: the launch directory of this run (resolved config, logs, the trainer's exit marker).
        done_marker: written by trainer node 0's agent with the trainer's exit code; agents that host engines wait for
            it before stopping them, so the last weight sync of rank 0 still finds its engines.
        weight_sync: the distributed weight-update group of the planned engines (None: external engines).
    """

    nodes: tuple[NodePlan, ...]
    placement: str
    engine_urls: tuple[str, ...]
    trainer_overrides: tuple[str, ...]
    resolved_config: str
    resolved_config_path: str
    run_dir: str
    done_marker: str
    weight_sync: WeightSyncGroup | None = None
    sync_per_node: tuple[str, ...] = ()

    def format(self) -> str:
        """Human-readable plan: per node, its role and the exact commands (what --dry-run prints)."""
        lines = [f"placement: {self.placement}; engines: {', '.join(self.engine_urls) or 'none'}",
                 f"resolved config: {self.resolved_config_path}"]
        if self.weight_sync is not None:
            ws = self.weight_sync
            lines.append(f"weight-update group: master {ws.master_address}, world size {ws.world_size}, engine rank "
                         f"offsets {', '.join(map(str, ws.rank_offsets))}")
        lines += self.sync_per_node
        for node in self.nodes:
            lines.append(f"node {node.node_rank} ({node.host}): {node.role}")
            for proc in node.processes:
                lines += [f"  [{proc.name}] {proc.shell()}", f"      log: {proc.log}"]
        return "\n".join(lines)


# Derived ports stay below 32768, where Linux's default ephemeral range (net.ipv4.ip_local_port_range 32768-60999)
# starts: a port in it can be handed to any outgoing connection or OS-picked listener on the node between the plan and
# the engine's bind ("Address already in use": the job is lost).
EPHEMERAL_START = 32768
MASTER_PORT_BASE, MASTER_PORTS = 20000, 2000
ENGINE_PORT_BASE, ENGINE_PORT_STRIDE, ENGINES_PER_JOB = 22000, 8, 64  # a job's engines count up from its first port


def derived_ports(job_id: str) -> tuple[int, int]:
    """(torchrun master port, first engine port) of a job: stable across processes (crc32, unlike hash()), spread
    over their ranges, both below EPHEMERAL_START even with ENGINES_PER_JOB engines."""
    crc = zlib.crc32(job_id.encode())
    engine_slots = (EPHEMERAL_START - ENGINE_PORT_BASE - ENGINES_PER_JOB) // ENGINE_PORT_STRIDE
    return MASTER_PORT_BASE + crc % MASTER_PORTS, ENGINE_PORT_BASE + crc % engine_slots * ENGINE_PORT_STRIDE


def _split_evenly(world_size: int, nodes: int) -> int:
    if world_size % nodes:
        raise PlanError(f"world_size={world_size} cannot be spread evenly over {nodes} trainer nodes; set "
                        f"world_size to a multiple of {nodes} or pass --trainer-nodes")
    return world_size // nodes


def trainer_layout(config: TrainConfig, allocation: Allocation, trainer_nodes: int | None) -> tuple[int, int]:
    """(trainer nodes, ranks per trainer node)."""
    nnodes, gpus, world = len(allocation.hosts), allocation.gpus_per_node, config.world_size
    if trainer_nodes is not None:
        if not 1 <= trainer_nodes <= nnodes:
            raise PlanError(f"--trainer-nodes={trainer_nodes}: the allocation has {nnodes} nodes")
        per_node = _split_evenly(world, trainer_nodes)
        if gpus and per_node > gpus:
            raise PlanError(f"world_size={world} on {trainer_nodes} nodes needs {per_node} GPUs per node; "
                            f"nodes have {gpus}")
        return trainer_nodes, per_node
    if gpus:
        if world <= gpus:
            return 1, world
        if world % gpus:
            raise PlanError(f"world_size={world} is not a multiple of the {gpus} GPUs per node")
        if world // gpus > nnodes:
            raise PlanError(f"world_size={world} needs {world // gpus} nodes of {gpus} GPUs; the allocation has "
                            f"{nnodes}")
        return world // gpus, gpus
    return nnodes, _split_evenly(world, nnodes)


def _environment(gpus: int, *, trainer: bool) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if gpus and trainer:
        # Megatron's TP/SP communication overlap needs ordered kernel launch; NCCL errors should abort, not hang.
        env.update({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    elif not gpus:
        # Several CPU "ranks" share a node's cores; more threads only oversubscribe.
        env["OMP_NUM_THREADS"] = "1"
    return env


def make_plan(config: TrainConfig, allocation: Allocation, options: LaunchOptions) -> Plan:
    """Compute every node's processes. Pure: same inputs, same plan, on every node."""
    import yaml

    from mpo.config import to_dict
    from mpo.config_checks import load_config

    hosts, gpus = allocation.hosts, allocation.gpus_per_node
    if not hosts:
        raise PlanError("the allocation has no nodes")
    nnodes = len(hosts)
    trainer_nodes, per_node = trainer_layout(config, allocation, options.trainer_nodes)
    derived_master, derived_engine = derived_ports(allocation.job_id)
    master_port = options.master_port or derived_master
    engine_port = options.engine_port or derived_engine
    run_dir = str(Path(config.logging.out_dir) / "launch" / allocation.job_id)
    env = _environment(gpus, trainer=True)
    engine_env = _environment(gpus, trainer=False)
    r = config.rollout

    # -- engines -----------------------------------------------------------------------------------------------------
    engines: dict[int, list[Process]] = {i: [] for i in range(nnodes)}
    urls: list[str] = []
    placement = "external"
    if not r.urls:
        if trainer_nodes < nnodes:  # the nodes after the trainer's
            candidates, placement = list(range(trainer_nodes, nnodes)), "disaggregated"
        else:  # the trainer's nodes, from the last: node 0 carries the fewest engines
            candidates, placement = list(range(nnodes - 1, -1, -1)), "colocated"
        gpus_per_engine = r.tensor_parallel if r.engine == "sglang" else 0
        if r.engine == "sglang" and not gpus:
            raise PlanError("rollout.engine='sglang' needs GPU nodes (--gpus-per-node, or a SLURM GPU allocation)")
        if r.engine == "sglang" and not config.model.hf_dir:
            raise PlanError("rollout.engine='sglang' needs model.hf_dir (the checkpoint SGLang loads)")
        # SGLang on GPUs shares them with the trainer when colocated: 0.4 of their memory unless told otherwise.
        mem = options.engine_mem_fraction
        if mem is None and placement == "colocated" and gpus_per_engine:
            mem = 0.4
        settings = EngineSettings.from_config(config.model, config.rollout, config.sync, seed=config.seed,
                                              mem_fraction=mem)
        if gpus_per_engine and gpus % gpus_per_engine:
            raise PlanError(f"rollout.tensor_parallel={gpus_per_engine} does not divide the {gpus} GPUs per node")
        slots = gpus // gpus_per_engine if gpus_per_engine else r.num_engines  # CPU engines are not GPU-bound
        if r.num_engines > slots * len(candidates):
            raise PlanError(f"rollout.num_engines={r.num_engines} engines of {gpus_per_engine} GPUs do not fit on "
                            f"the {len(candidates)} {placement} node(s) ({slots} per node)")
        for i in range(r.num_engines):
            node = candidates[i // slots] if gpus_per_engine else candidates[i % len(candidates)]
            try:
                if placement == "colocated" and gpus_per_engine:  # SGLang on trainer GPUs: first, it says why
                    transport_class(config.sync.transport).check_colocated(r.engine)
                if node >= trainer_nodes:
                    check_transport(config.sync.transport, r.engine,
                                    off_host=f"engine{i} is placed on rollout node {hosts[node]}")
                # colocated on a trainer node: a same-host transport reaches it from that node's leader rank
                # (mpo.weight_sync.relay, told the node by MPO_NODE_HOST below)
            except ValueError as exc:
                raise PlanError(str(exc)) from None
            local = len(engines[node])
            port = engine_port + i
            proc_env = dict(engine_env)
            if gpus_per_engine:
                first = local * gpus_per_engine
                proc_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, first + gpus_per_engine))
            url = f"http://{hosts[node]}:{port}"
            urls.append(url)
            command = engine_command(settings, python=options.engine_python or options.python, host=hosts[node],
                                     port=port)
            engines[node].append(Process(
                name=f"engine{i}", kind="engine", argv=command.argv, env={**proc_env, **command.env},
                log=f"{run_dir}/node{node}-{hosts[node]}/engine{i}.log", url=url))

    # -- trainer -----------------------------------------------------------------------------------------------------
    # Engines reach trainer global rank 0 (trainer node 0) for the distributed weight-update group.
    weight_sync = None
    trainer_overrides: tuple[str, ...] = ()
    if urls:
        tp_sizes = (settings.tensor_parallel,) * len(urls)
        world_size, offsets = group_layout(tp_sizes)
        weight_sync = WeightSyncGroup(master_address=hosts[0], world_size=world_size, rank_offsets=tuple(offsets),
                                      tp_sizes=tp_sizes)
        trainer_overrides = (f"rollout.urls=[{','.join(urls)}]", f"sync.master_address={hosts[0]}")
    resolved = load_config(options.config_path, [*options.overrides, *trainer_overrides])
    resolved_text = yaml.safe_dump(to_dict(resolved), sort_keys=False)
    resolved_path = f"{run_dir}/config.yaml"
    nodes = []
    for k, host in enumerate(hosts):
        procs = list(engines[k])
        log_dir = f"{run_dir}/node{k}-{host}"
        if k < trainer_nodes:
            argv = (options.python, "-m", "torch.distributed.run", "--nnodes", str(trainer_nodes),
                    "--node-rank", str(k), "--nproc-per-node", str(per_node), "--master-addr", hosts[0],
                    "--master-port", str(master_port), "--max-restarts", "0",
                    "--log-dir", f"{log_dir}/ranks", "--redirects", "3", "--tee", "3",
                    "-m", "mpo.trainer", "--config", resolved_path)
            # engines on several trainer nodes: the host their URLs name, by which a per-node sync routes buckets
            # (mpo.weight_sync.relay; emulated nodes may share one machine, whose own names cannot tell them apart)
            node_env = {**env, NODE_HOST_ENV: host} if placement == "colocated" and trainer_nodes > 1 else env
            procs.insert(0, Process(name="trainer", kind="trainer", argv=argv, env=dict(node_env),
                                    log=f"{log_dir}/trainer.log"))
        roles = [role for role, present in (("trainer", k < trainer_nodes), ("rollout", bool(engines[k]))) if present]
        nodes.append(NodePlan(node_rank=k, host=host, role="+".join(roles) or "idle", processes=tuple(procs),
                              log_dir=log_dir))
    per_node_lines: tuple[str, ...] = ()
    if placement == "colocated" and trainer_nodes > 1 and same_host(config.sync.transport, r.engine):
        # mpo.weight_sync.relay: a node's leader is its lowest rank (torchrun gives node k ranks k * per_node ...)
        leaders = {k: k * per_node for k in range(trainer_nodes)}
        per_node_lines = (f"weight sync per node (sync.transport={config.sync.transport}): each stage's sender pushes "
                          f"to its own node's engines and hands each bucket to the other nodes' leaders, which push "
                          f"it to theirs",) + tuple(
            f"  node {k} ({hosts[k]}): leader rank {leaders[k]} -> {', '.join(p.name for p in engines[k])}"
            for k in range(trainer_nodes) if engines[k])
    return Plan(nodes=tuple(nodes), placement=placement, engine_urls=tuple(urls), sync_per_node=per_node_lines,
                trainer_overrides=trainer_overrides, resolved_config=resolved_text,
                resolved_config_path=resolved_path, run_dir=run_dir, done_marker=f"{run_dir}/trainer.exit",
                weight_sync=weight_sync)
