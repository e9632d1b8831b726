"""What the first run on a GPU would hit, checked on CPU (issue #30): the layer spec without Transformer Engine, host
tensors meeting device tensors, collectives handed host tensors. None of this can run CUDA here, so each test
checks the device logic by other means, named in its docstring: a stub model on the `meta` device (it records where
its inputs arrive), fake CUDA tensors (torch's FakeTensorMode propagates devices and raises on a mismatch, without a
GPU), or an inspection of the source. What these cannot show (results coming back from a real GPU) is the offline
GPU tier's job (tests/gpu/run.sh --offline).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


# -- the layer spec ----------------------------------------------------------------------------------------------

@pytest.fixture
def gpu_without_te(monkeypatch):
    """A machine that says it has CUDA and whose Transformer Engine does not import (the offline GPU machine)."""
    from mpo.parallel import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "transformer_engine_problem",
                        lambda: "transformer_engine is not importable (ModuleNotFoundError: ...)")
    monkeypatch.delenv("MPO_LAYER_SPEC", raising=False)
    return device


def test_gpu_without_transformer_engine_falls_back_to_the_local_spec(gpu_without_te, caplog):
    profile = gpu_without_te.detect_device(0)
    assert (profile.device.type, profile.backend, profile.layer_spec) == ("cuda", "nccl", "local")
    assert "local layer spec" in caplog.text and "MPO_LAYER_SPEC=te" in caplog.text


def test_layer_spec_override_and_its_errors(gpu_without_te, monkeypatch):
    device = gpu_without_te
    monkeypatch.setenv("MPO_LAYER_SPEC", "te")
    with pytest.raises(ValueError, match="MPO_LAYER_SPEC=te but transformer_engine is not importable"):
        device.detect_device(0)
    with pytest.raises(ValueError, match="MPO_LAYER_SPEC=te needs a CUDA device"):
        device.detect_device(0, force_cpu=True)
    monkeypatch.setenv("MPO_LAYER_SPEC", "fast")
    with pytest.raises(ValueError, match="MPO_LAYER_SPEC='fast'; valid values: te, local"):
        device.detect_device(0)
    monkeypatch.setattr(device, "transformer_engine_problem", lambda: None)  # TE importable
    monkeypatch.setenv("MPO_LAYER_SPEC", "local")
    assert device.detect_device(0).layer_spec == "local"
    monkeypatch.delenv("MPO_LAYER_SPEC")
    assert device.detect_device(0).layer_spec == "te"
    assert device.detect_device(0, force_cpu=True).layer_spec == "local"


def test_local_spec_on_gpu_does_not_ask_for_grouped_gemm():
    """Grouped GEMM experts come from Transformer Engine; a GPU profile on the local spec must build SequentialMLP
    experts (megatron's GroupedMLP needs the grouped_gemm package, which no image here has)."""
    from mpo.models.builder import transformer_config
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig
    from mpo.parallel.device import DeviceProfile

    local_gpu = DeviceProfile(torch.device("cuda", 0), "nccl", "local", cpu_initialization=False)
    assert transformer_config(preset("tiny-2layer"), ParallelConfig(), local_gpu).moe_grouped_gemm is False
    te_gpu = DeviceProfile(torch.device("cuda", 0), "nccl", "te", cpu_initialization=False)
    assert transformer_config(preset("tiny-2layer"), ParallelConfig(), te_gpu).moe_grouped_gemm is True


# -- collectives -------------------------------------------------------------------------------------------------

COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single"}
# Where a tensor collective may be called directly: the device-aware helper itself; the vocab-parallel log-prob
# reductions (their tensors are made from the logits, on the compute device); mpo's engine receiving into its own
# buffers on its own gloo weight-update group.
DIRECT_COLLECTIVES_ALLOWED = {"mpo/parallel/collectives.py", "mpo/models/logprobs.py",
                              "mpo/engine/weight_routes.py"}


def test_no_tensor_collective_outside_the_device_aware_helper():
    """By inspection of the source: NCCL reduces only CUDA tensors, and the trainer builds its bookkeeping tensors on
    the host, so every tensor collective of the step loop goes through mpo.parallel.collectives.all_reduce_ (which
    moves the tensor to the group's device and back). A direct `dist.all_reduce(host_tensor)` on the NCCL world
    group fails at the first sync on a GPU. (Point-to-point sends in mpo.weight_sync.gather move slots made on the
    gather device; their host tokens exist only with host shared memory, i.e. on CPU.)"""
    offenders = []
    for path in sorted((REPO / "mpo").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in DIRECT_COLLECTIVES_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"):
                offenders.append(f"{rel}:{node.lineno}: dist.{node.func.attr}")
    assert not offenders, ("direct tensor collectives (use mpo.parallel.collectives.all_reduce_): "
                           + "; ".join(offenders))


# -- routes: host-placed engine routes against routes captured on the GPU ------------------------------------------

@pytest.mark.parametrize("engine_device, captured_device", [("cpu", "cuda"), ("cuda", "cpu")])
def test_routing_agreement_takes_routes_from_two_devices(engine_device, captured_device):
    """FakeTensorMode (no GPU needed): tensors carry a device and no values; an op mixing two devices raises
    FakeTensorDeviceMismatchError, and the first read of a value (`.item()`) raises DataDependentOutputException. So
    reaching the first value read means every tensor op of the comparison ran with consistent devices."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from mpo.routing import agreement_metrics
    from mpo.routing.records import MicroBatchRouting

    with FakeTensorMode():
        engine = MicroBatchRouting((1, 2), torch.randint(0, 8, (2, 5, 2, 2), device=engine_device))
        captured = MicroBatchRouting((1, 2), torch.randint(0, 8, (2, 5, 2, 2), device=captured_device))
        valid = torch.ones(2, 5, dtype=torch.bool, device=captured_device)
        with pytest.raises(DataDependentOutputException):
            agreement_metrics([engine], [captured], [valid], prefix="routing/rollout_vs_old", num_layers=2)


# -- mpo's engine: inputs built on the host go to the model's device ------------------------------------------------

class _Gate(torch.nn.Module):
    """A router's stand-in: (logits, weights, top-2 indices) as transformers' MoE routers answer."""

    def forward(self, hidden):
        return None, None, torch.zeros(hidden.shape[0], 2, dtype=torch.int64)


class _MetaModel(torch.nn.Module):
    """A stand-in for the engine's transformers model whose parameters live on the `meta` device (a device that is
    not the CPU, available without a GPU); it records where its inputs arrive and answers with host logits, calling
    its one MoE layer's router as the real model does."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab, device="meta"))
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.gate = _Gate()
        self.vocab = vocab
        self.seen: list[torch.device] = []

    def forward(self, input_ids, position_ids, use_cache=False, past_key_values=None):
        self.seen += [input_ids.device, position_ids.device]
        self.model.layers[0].mlp.gate(torch.zeros(input_ids.numel(), 1))
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def _engine(vocab: int = 16):
    from mpo.models.config import preset
    from mpo.engine.model import EngineModel

    model = _MetaModel(vocab)
    return EngineModel(model, preset("tiny-2layer").with_overrides(vocab_size=vocab)), model


def test_engine_logits_run_on_the_models_device():
    engine, model = _engine()
    logits = engine.logits(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert model.seen == [torch.device("meta")] * 2, f"inputs arrived on {model.seen}, the model is on meta"
    assert logits.shape == (2, 3, 16)


def test_engine_scoring_runs_on_the_models_device():
    engine, model = _engine()
    scored = engine.score([[1, 2, 3, 4], [5, 6]], want_routes=True)
    assert model.seen == [torch.device("meta")] * 2, f"the scored batch arrived on {model.seen}, the model is on meta"
    assert scored[0][0][0] == 0.0 and len(scored[0][0]) == 4 and len(scored[1][0]) == 2
    assert scored[0][1].shape == (3, 1, 2) and scored[1][1].shape == (1, 1, 2)


def test_cuda_ipc_payload_builds_and_loads_back():
    """Failed on the first GPU run (torch 2.11: `torch.multiprocessing.reductions` no longer re-exports
    ForkingPickler). On CPU the same pickler reduces the flat tensor to a shared-memory handle instead of a CUDA IPC
    handle; loading it back in this process checks the payload's framing, not the IPC (that is the GPU tier's
    `cuda_ipc` step)."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    from mpo.weight_sync.wire import cuda_ipc_payload

    named = [("a.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b.bias", torch.ones(4))]
    from mpo.weight_sync.wire import unpack_bucket

    flat = ForkingPickler.loads(base64.b64decode(cuda_ipc_payload(named)))
    assert [m.name for m in flat["metadata"]] == ["a.weight", "b.bias"]
    assert flat["flattened_tensor"].dtype == torch.uint8  # one buffer (one handle) for every dtype of the bucket
    got = unpack_bucket(flat["flattened_tensor"], flat["metadata"])
    assert [t.tolist() for _, t in got] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [1.0, 1.0, 1.0, 1.0]]
