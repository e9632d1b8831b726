"""Weight sync at scale: a ~1.5B-parameter MoE (preset gpu_1b: 2.9 GB in bf16 + an FP32 LM head) from a trainer
process into a real SGLang server, over CUDA IPC (server on the same GPU, flattened buckets of CUDA tensors, see
sync_worker) and over NCCL (WeightSync "distributed"; server on a second GPU).

Checked: the server's probe log-probs move with the pushed weights and return exactly when the first weights are
pushed again. Reported, not asserted (timing is a benchmark's job): seconds per GB of each transport.

NCCL needs two GPUs: NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected"), so on a
one-GPU machine that case skips with that reason, loudly (this tier's only hardware precondition).
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers.spawn import spawn_ranks

pytestmark = pytest.mark.gpu

PRESET = "gpu_1b"
PROBE = [1 + (7 * i) % 32000 for i in range(16)]
BUCKET_MB = 512
ROUNDS = 3


@pytest.fixture(scope="module", params=["cuda_ipc", "nccl"])
def results(request, tmp_path_factory) -> dict:
    import sync_worker
    from mpo.models.config import preset
    from sglang_gpu import start_gpu_sglang_server, write_hf_config_dir
    from tier import needs_sglang

    needs_sglang()
    transport = request.param
    server_gpu = 0
    if transport == "nccl":
        if torch.cuda.device_count() < 2:
            reason = (f"WEIGHT SYNC OVER NCCL NOT MEASURED: needs 2 GPUs, this machine has "
                      f"{torch.cuda.device_count()} (NCCL rejects two ranks on one GPU: 'Duplicate GPU detected')")
            print(f"\n{'!' * 100}\n{reason}\n{'!' * 100}", file=sys.stderr)
            pytest.skip(reason)
        server_gpu = 1
    work = tmp_path_factory.mktemp(f"sync_1b_{transport}")
    model_dir = write_hf_config_dir(preset(PRESET), work / "hf")
    with start_gpu_sglang_server(model_dir, dummy_weights=True, mem_fraction=0.3,
                                 extra_args=["--base-gpu-id", str(server_gpu)]) as server:
        spawn_ranks(1, sync_worker.run, str(work / "out.pt"), server.url, PRESET, PROBE, transport, BUCKET_MB,
                    ROUNDS)
    return {"transport": transport, **torch.load(work / "out.pt", weights_only=False)}


def _probe(results: dict, key: str) -> torch.Tensor:
    return torch.tensor(results["probe"][key], dtype=torch.float64)


def test_weights_arrive(results):
    assert results["parameters"] >= 1_000_000_000, results["parameters"]
    moved = (_probe(results, "0a") - _probe(results, "1b")).abs().max().item()
    back = (_probe(results, "0a") - _probe(results, "2a")).abs().max().item()
    gigabytes = results["bytes"] / 1e9
    print(f"\n[gpu] weight sync {results['transport']}: {results['parameters'] / 1e9:.2f}B parameters, "
          f"{gigabytes:.2f} GB, median {results['median_s']:.2f} s over {len(results['seconds'])} pushes = "
          f"{results['median_s'] / gigabytes:.3f} s/GB; probe moved {moved:.3f}, came back within {back:.1e}",
          file=sys.stderr)
    assert moved > 1e-2, "the server's log-probs did not change with the weights"
    assert back <= 1e-6, "pushing the first weights again did not restore the first log-probs"
