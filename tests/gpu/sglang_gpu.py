"""A real SGLang 0.5.23 server on the GPU, for the GPU tier.

The CPU harness (tests/helpers/sglang_server.py) starts SGLang with a stand-in `sgl_kernel` and `--device cpu`; on
a GPU the unmodified server runs with its own CUDA kernels, from the venv tests/gpu/run.sh makes ($MPO_SGLANG_VENV,
default `.venv-gpu-sglang`). The process handling (readiness poll, process-group stop) is the CPU harness's
SGLangServer, reused as is; only the command line and environment differ.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from helpers.sglang_server import REPO_ROOT, SGLANG_VERSION, SGLangServer, launch_server
from mpo.parallel.ports import free_port


def gpu_sglang_python() -> Path:
    return Path(os.environ.get("MPO_SGLANG_VENV", REPO_ROOT / ".venv-gpu-sglang")) / "bin" / "python"


def _server_env() -> dict[str, str]:
    """The caller's environment minus our venv's paths, offline hub (the test models are local directories)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def check_gpu_sglang() -> str:
    """The venv's sglang version; raises RuntimeError (the tier fails, it does not skip) when it is not usable."""
    python = gpu_sglang_python()
    if not python.exists():
        raise RuntimeError(f"{python} not found: run `bash tests/gpu/run.sh` (it installs sglang=={SGLANG_VERSION})")
    out = subprocess.run([str(python), "-c", "import sglang, sgl_kernel; print(sglang.__version__)"],
                         env=_server_env(), capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or out.stdout.strip().splitlines()[-1:] != [SGLANG_VERSION]:
        raise RuntimeError(f"sglang {SGLANG_VERSION} with CUDA kernels is not importable from {python}: "
                           f"{(out.stderr or out.stdout).strip()[-800:]}")
    return SGLANG_VERSION


def start_gpu_sglang_server(model_dir: Path, *, mem_fraction: float = 0.25, dummy_weights: bool = False,
                            extra_args: list[str] = (), ready_timeout: float = 900.0) -> SGLangServer:
    """`python -m sglang.launch_server` on GPU 0: bf16 body, FP32 LM head, routed experts returned (R3), CUDA graphs
    off (start-up time; they do not change the numbers compared here). `dummy_weights`: random init from
    config.json alone (the weight-sync test pushes every weight itself)."""
    check_gpu_sglang()
    port = free_port()
    log_path = Path(model_dir) / f"sglang-gpu-{port}.log"
    cmd = [str(gpu_sglang_python()), "-m", "sglang.launch_server", "--model-path", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enable-fp32-lm-head",
           "--enable-return-routed-experts", "--mem-fraction-static", str(mem_fraction), "--disable-cuda-graph",
           *(["--load-format", "dummy"] if dummy_weights else []), *extra_args]
    return launch_server(cmd, _server_env(), port=port, log_path=log_path, cwd=Path(model_dir), api_key=None,
                         ready_timeout=ready_timeout)


def write_hf_config_dir(model_cfg, out_dir: Path) -> Path:
    """config.json (+ the tests' WordLevel tokenizer) for an mpo preset, enough for SGLang's dummy-weight load."""
    from helpers.tiny_hf import make_tokenizer
    from mpo.models.config import to_hf_config

    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**to_hf_config(model_cfg), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 3}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    make_tokenizer(model_cfg.vocab_size).save_pretrained(out_dir)
    return out_dir
