"""verify: the HF model (transformers) and the converted megatron checkpoint (mpo, any layout) on the same prompts.

Reports max |logit diff|, max |log-prob diff| and, per MoE layer, the fraction of tokens whose top-k expert set is
identical. Megatron runs in freshly spawned gloo ranks (also for one rank), so the HF reference runs in a process
that never imported megatron's CPU shims; HF's rotary `inv_freq` is still checked against a fresh computation.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mpo.models.hf_source import ConversionError, read_json
from mpo.parallel.ports import free_port

DEFAULT_TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    """Parity of HF and megatron on the same prompts.

    Attributes:
        layout: the megatron layout used (tp, ep, pp).
        max_logit_diff: max |logits_hf - logits_mcore| over prompts, positions and the real vocabulary.
        max_logprob_diff: max |log p_hf(token) - log p_mcore(token)| for the next-token log-probs.
        routing_agreement: per MoE layer, fraction of tokens with the same top-k expert set.
        tolerance: threshold on both diffs.
    """

    layout: dict
    max_logit_diff: float
    max_logprob_diff: float
    routing_agreement: dict[int, float] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def passed(self) -> bool:
        return (self.max_logit_diff <= self.tolerance and self.max_logprob_diff <= self.tolerance
                and all(a == 1.0 for a in self.routing_agreement.values()))

    def lines(self) -> list[str]:
        out = [f"layout {self.layout}",
               f"max |logit diff|   {self.max_logit_diff:.3e}",
               f"max |logprob diff| {self.max_logprob_diff:.3e}"]
        out += [f"layer {i:3d} top-k routing agreement {a:.4f}" for i, a in sorted(self.routing_agreement.items())]
        out.append(f"{'PASS' if self.passed else 'FAIL'} (tolerance {self.tolerance:g}, routing must agree exactly)")
        return out


def default_prompts(vocab_size: int, batch: int = 2, length: int = 16, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen).tolist()


def hf_reference(hf_dir: str | Path, prompts: list[list[int]]) -> dict:
    """Logits [b,s,V], next-token log-probs [b,s] (position 0 = 0) and per-layer sorted top-k [b*s,k] from HF."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load of a small reference model: verify prints its own result lines
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    _check_rotary(model)
    routing: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def capture(_module, _inputs, output, index=index):
            routing[index] = torch.sort(output[2], dim=-1).values  # DSv3 uses topk(sorted=False)
        handles.append(gate.register_forward_hook(capture))
    ids = torch.tensor(prompts, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits.float()
    for handle in handles:
        handle.remove()
    return {"logits": logits, "logprobs": next_token_logprobs(logits, ids), "routing": routing}


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b,s] with position t holding log p(ids[t] | ids[<t]) and position 0 zero (mpo's convention)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1).float()


def _check_rotary(model) -> None:
    rotary = getattr(model.model, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or getattr(rotary, "rope_type", "default") != "default":
        return
    dim = inv_freq.numel() * 2
    base = model.config.rope_parameters.get("rope_theta", 10000.0) if getattr(model.config, "rope_parameters", None) \
        else getattr(model.config, "rope_theta", 10000.0)
    fresh = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not torch.allclose(inv_freq.float().cpu(), fresh, rtol=1e-6, atol=0):
        raise RuntimeError("HF rotary inv_freq is corrupted in this process; HF reference logits cannot be trusted")


def _rank_entry(rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from checkpoints_tools.mcore_runner import run_rank
    from mpo.safe_load import CheckpointFileError

    try:
        run_rank(*args)
        return
    except (ConversionError, CheckpointFileError) as exc:
        # One line for the parent (which raises it as a ConversionError) instead of a traceback per rank.
        message = str(exc).replace("\n", " ")
    except Exception as exc:  # megatron's own load errors (missing keys, shape mismatch) and anything else
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        message = f"megatron rank {rank} failed: {type(exc).__name__}: {lines[0] if lines else ''}"
    Path(f"{args[3]}.error-rank{rank}").write_text(message)  # args[3]: the output file (run_rank's out_file)
    os._exit(2)


def world_size_for(tp: int, ep: int, pp: int, etp: int | None) -> int:
    """The smallest world size that fits the layout (dense grid tp*pp, expert grid etp*ep*pp)."""
    expert_grid = (etp or tp) * ep * pp
    world = max(tp * pp, expert_grid)
    if world % (tp * pp) or world % expert_grid:
        raise ConversionError(f"layout tp={tp} ep={ep} pp={pp} etp={etp} has no common world size")
    return world


def run_mcore(mcore_dir: str | Path, prompts: list[list[int]], *, tp: int = 1, ep: int = 1, pp: int = 1,
              etp: int | None = None, pp_first: int | None = None, pp_last: int | None = None,
              vpp: int | None = None, resave_dir: str | Path | None = None) -> dict:
    """Megatron outputs for the prompts at a layout, on the smallest world size that fits it. pp_first / pp_last
    are the layer counts of the first / last pipeline stage (uneven stages), vpp the virtual stages per stage.

    A rank that fails raises ConversionError here with its one-line reason."""
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    layout = dict(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, expert_tensor_parallel=etp,
                  num_layers_in_first_stage=pp_first, num_layers_in_last_stage=pp_last,
                  virtual_pipeline_parallel=vpp)
    world = world_size_for(tp, ep, pp, etp)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "mcore.pt")
        for attempt in range(3):
            try:
                mp.start_processes(_rank_entry, args=(world, free_port(), (str(mcore_dir), prompts, layout, out_file,
                                                                           str(resave_dir) if resave_dir else None)),
                                   nprocs=world, join=True, start_method="spawn")
                break
            except (ProcessExitedException, ProcessRaisedException) as exc:
                errors = sorted(Path(tmp).glob("mcore.pt.error-rank*"))
                message = errors[0].read_text().strip() if errors else ""
                for error in errors:
                    error.unlink()
                # the port free_port saw free was taken before rank 0 bound it (another job on the host): new port
                if "EADDRINUSE" in message and attempt < 2:
                    continue
                if message:
                    raise ConversionError(message, file=str(mcore_dir)) from None
                raise ConversionError(f"a megatron rank failed: {str(exc).strip().splitlines()[0]}",
                                      file=str(mcore_dir)) from None
        return torch.load(out_file, weights_only=True)


def compare(hf: dict, mcore: dict, layout: dict, tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    vocab = hf["logits"].shape[-1]
    logit_diff = (hf["logits"] - mcore["logits"][..., :vocab]).abs().max().item()
    logprob_diff = (hf["logprobs"][:, 1:] - mcore["logprobs"][:, 1:]).abs().max().item()
    agreement = {}
    for layer, hf_topk in hf["routing"].items():
        got = mcore["routing"].get(layer)
        same_shape = got is not None and got.shape == hf_topk.shape
        agreement[layer] = (got == hf_topk).all(-1).float().mean().item() if same_shape else 0.0
    for layer in mcore["routing"]:
        agreement.setdefault(layer, 0.0)  # megatron routes where HF does not: a mapping error
    return VerifyReport(layout, logit_diff, logprob_diff, agreement, tolerance)


def verify(hf_dir: str | Path, mcore_dir: str | Path, *, tp: int = 1, ep: int = 1, pp: int = 1,
           etp: int | None = None, pp_first: int | None = None, pp_last: int | None = None,
           vpp: int | None = None, prompts: list[list[int]] | None = None,
           tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    """Run both models on the same prompts and compare (see VerifyReport).

    Inputs are checked before any rank starts (ConversionError, one line): both directories, both config files,
    the torch_dist metadata and stored objects (read safely, mpo.safe_load), and the layout against the model."""
    stages = dict(pp_first=pp_first, pp_last=pp_last, vpp=vpp)
    mcore_dir = _torch_dist_dir(mcore_dir)
    model_cfg = check_inputs(hf_dir, mcore_dir, tp=tp, ep=ep, pp=pp, etp=etp, **stages)
    prompts = prompts or default_prompts(model_cfg.vocab_size, batch=max(2, pp if vpp else 2))
    mcore = run_mcore(mcore_dir, prompts, tp=tp, ep=ep, pp=pp, etp=etp, **stages)
    hf = hf_reference(hf_dir, prompts)
    layout = dict(tp=tp, ep=ep, pp=pp, etp=etp, **{k: v for k, v in stages.items() if v is not None})
    return compare(hf, mcore, layout, tolerance)


# Layout stage fields (bare or under "parallel.") as this CLI's flags, so a layout error names what to change here.
_FLAGS = {"num_layers_in_first_stage": "--pp-first", "num_layers_in_last_stage": "--pp-last",
          "virtual_pipeline_parallel": "--vpp"}


def _as_flags(message: str) -> str:
    import re

    return re.sub(r"(?:parallel\.)?(" + "|".join(_FLAGS) + ")", lambda m: _FLAGS[m.group(1)], message)


def _torch_dist_dir(mcore_dir: str | Path) -> Path:
    """--mcore-dir as a torch_dist directory: itself, or a run directory's newest trainer checkpoint (a trainer
    checkpoint's step directory is one: its policy keys are unprefixed and it carries hf_config.json)."""
    from mpo.model_files import NotACheckpoint, resolve_mcore_dir

    if not Path(mcore_dir).is_dir():
        raise ConversionError("--mcore-dir: directory does not exist", file=str(mcore_dir))
    try:
        return resolve_mcore_dir(mcore_dir)
    except NotACheckpoint:
        return Path(mcore_dir)  # check_inputs says what is missing


def check_inputs(hf_dir: str | Path, mcore_dir: str | Path, *, tp: int, ep: int, pp: int, etp: int | None,
                 pp_first: int | None = None, pp_last: int | None = None, vpp: int | None = None):
    """The model config of the HF config.json, after checking everything verify needs (see `verify`)."""
    from checkpoints_tools.convert import HF_CONFIG_NAME
    from checkpoints_tools.torch_dist_io import TorchDistReader
    from mpo.models.hf_mapping import model_config_from_hf
    from mpo.parallel.config import LayoutError, ParallelConfig

    hf_dir, mcore_dir = Path(hf_dir), Path(mcore_dir)
    for name, directory in (("--hf-dir", hf_dir), ("--mcore-dir", mcore_dir)):
        if not directory.is_dir():
            raise ConversionError(f"{name}: directory does not exist", file=str(directory))
    model_cfg = model_config_from_hf(read_json(hf_dir / "config.json"), file=str(hf_dir / "config.json"))
    model_config_from_hf(read_json(mcore_dir / HF_CONFIG_NAME), file=str(mcore_dir / HF_CONFIG_NAME))
    TorchDistReader(mcore_dir).check_objects()
    try:
        layout = ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp,
                                expert_tensor_parallel=etp, sequence_parallel=False,
                                num_layers_in_first_stage=pp_first, num_layers_in_last_stage=pp_last,
                                virtual_pipeline_parallel=vpp)
        layout.validate(world_size_for(tp, ep, pp, etp), num_layers=model_cfg.num_layers,
                        num_attention_heads=model_cfg.num_attention_heads,
                        num_query_groups=model_cfg.num_query_groups, num_experts=model_cfg.num_experts)
    except LayoutError as exc:
        raise ConversionError(f"layout: {_as_flags(str(exc))}") from None
    return model_cfg
