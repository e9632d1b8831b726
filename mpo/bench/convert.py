"""Checkpoint conversion throughput and memory: `python -m mpo.bench convert [--size-gb 2]`.

Generates a random Qwen3-MoE-shaped bf16 HF checkpoint of about --size-gb under a temporary directory, then, each in
a fresh subprocess (so peak RSS is that step's own):
  * plain read: every tensor through safe_open.get_tensor (the floor any converter pays to read the files);
  * read + raw write: the same, plus writing the bytes to one file and fsync (the floor for reading and writing);
  * hf-to-mcore: checkpoints_tools' streaming conversion to torch_dist;
  * mcore-to-hf: back to HF safetensors shards.
Reports GB/s of each, the conversions' throughput relative to the plain read, and peak RSS against the largest
tensor. The page cache is warm for all three (the generated files were just written), which is fair between them.
Everything is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_CHILD = r"""
import json, resource, sys, threading, time
sys.path.insert(0, {root!r})
import torch
import torch.distributed.checkpoint  # its ~2 s of lazy imports are start-up, not throughput
from pathlib import Path
from safetensors import safe_open
from checkpoints_tools import hf_to_mcore, mcore_to_hf

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0

peak = [rss_anon()]
base = peak[0]
done = threading.Event()
def sample():
    while not done.wait(0.005):
        peak[0] = max(peak[0], rss_anon())
threading.Thread(target=sample, daemon=True).start()
step, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
start = time.perf_counter()
if step == "read":
    total = 0
    for path in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name).clone()  # get_tensor alone may stay a lazy mmap view
                total += tensor.numel() * tensor.element_size()
elif step == "copy":
    import os
    total = 0
    with open(dst, "wb") as out:
        for path in sorted(Path(src).glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name).clone()
                    out.write(tensor.view(torch.uint8).numpy().tobytes())
                    total += tensor.numel() * tensor.element_size()
        out.flush()
        os.fsync(out.fileno())
elif step == "hf-to-mcore":
    total = hf_to_mcore(src, dst, show_progress=False).bytes
else:
    total = mcore_to_hf(src, dst, show_progress=False).bytes
seconds = time.perf_counter() - start
done.set()
peak[0] = max(peak[0], rss_anon())
print(json.dumps({{"bytes": total, "seconds": seconds, "anon_base": base, "anon_peak": peak[0],
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def _config(size_gb: float) -> dict:
    """Qwen3-MoE-like shapes; the number of layers sets the size."""
    hidden, heads, kv_heads, head_dim, experts, inter, vocab = 1024, 16, 4, 64, 32, 512, 32000
    per_layer = 2 * (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + experts * 3 * inter * hidden
                     + experts * hidden + 2 * hidden + 2 * head_dim)
    vocab_bytes = 2 * 2 * vocab * hidden
    layers = max(1, int((size_gb * 2**30 - vocab_bytes) // per_layer))
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 4 * hidden, "moe_intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16"}


def _generate(directory: Path, config: dict) -> tuple[int, int]:
    """Random bf16 tensors in shards of at most 256 MiB; returns (total bytes, largest tensor bytes)."""
    from checkpoints_tools.hf_writer import StreamingSafetensorsWriter
    from mpo.models.hf_mapping import mapping_for, model_config_from_hf

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    mapping = mapping_for(model_config_from_hf(config))
    plan = [(name, tuple(shape), torch.bfloat16) for unit in mapping.units()
            for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)]
    writer = StreamingSafetensorsWriter(directory, plan, max_shard_bytes=256 << 20)
    gen = torch.Generator().manual_seed(0)
    for name, shape, _ in plan:
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    return writer.total_bytes, max(math.prod(shape) * 2 for _, shape, _ in plan)


def _run_step(step: str, src: Path, dst: Path) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=root), step, str(src), str(dst)], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench convert", description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--tmp", default=None, help="parent directory for the generated files (default: /tmp)")
    args = parser.parse_args(argv)

    base = Path(tempfile.mkdtemp(prefix="mpo-bench-convert-", dir=args.tmp))
    try:
        config = _config(args.size_gb)
        start = time.perf_counter()
        total, largest = _generate(base / "hf", config)
        print(f"generated {total / 2**30:.2f} GiB Qwen3-MoE-shaped bf16 checkpoint ({config['num_hidden_layers']} "
              f"layers x {config['num_experts']} experts) in {time.perf_counter() - start:.1f}s; largest tensor "
              f"{largest / 2**20:.1f} MiB")
        results = {
            "plain safe_open read": _run_step("read", base / "hf", base / "unused"),
            "read + raw write+fsync": _run_step("copy", base / "hf", base / "copy.bin"),
            "hf-to-mcore": _run_step("hf-to-mcore", base / "hf", base / "mc"),
            "mcore-to-hf": _run_step("mcore-to-hf", base / "mc", base / "hf_back"),
        }
        floor = results["plain safe_open read"]
        print(f"{'step':22s} {'GiB':>5s} {'s':>6s} {'GiB/s':>6s} {'vs read':>7s} {'anon peak-base MiB':>19s} "
              f"{'/largest':>8s} {'max RSS MiB':>11s}")
        for name, r in results.items():
            rate = r["bytes"] / 2**30 / r["seconds"]
            rel = rate / (floor["bytes"] / 2**30 / floor["seconds"])
            anon = r["anon_peak"] - r["anon_base"]
            print(f"{name:22s} {r['bytes'] / 2**30:5.2f} {r['seconds']:6.2f} {rate:6.2f} {rel:7.2f} "
                  f"{anon / 2**20:19.0f} {anon / largest:8.1f} {r['max_rss'] / 2**20:11.0f}")
        print("anon peak-base: anonymous memory above the process's baseline after imports (sampled every 5 ms); "
              "max RSS also counts mmap'd file pages and the runtime.")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
