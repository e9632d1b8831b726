"""Checks on the image files that need no build (`bash docker/test.sh`, run by .ci/run, builds and runs the CPU image
with podman; the GPU image needs NGC's base, which cannot be pulled here): versions live only in docker/versions.env
and agree with pyproject.toml, tests/requirements-ci.txt and the README (one torch version everywhere, the GPU image's
trainer and SGLang venv included), every Dockerfile ARG is provided by versions.env or has its own default and is
used, both bases are build arguments, the GPU image installs (and asserts) the Transformer Engine version it declares
and checks one NCCL, tests/gpu/run.sh takes its versions from versions.env, every file or directory the Dockerfiles
COPY exists, and slurm/ documents running from the image. The `container` tests run docker/'s helper scripts as
processes (the pip configuration handed to a build; build.sh without docker or podman)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))


def _versions() -> dict[str, str]:
    pairs = {}
    for line in (REPO / "docker" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            pairs[key] = value
    return pairs


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def _ci_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "tests" / "requirements-ci.txt").read_text().splitlines():
        if "==" in line:
            name, version = line.split("#")[0].strip().split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.parametrize("key, package", [("TORCH_VERSION", "torch"), ("MEGATRON_CORE_VERSION", "megatron-core"),
                                          ("TRANSFORMERS_VERSION", "transformers"),
                                          ("TRANSFORMER_ENGINE_VERSION", "transformer-engine"),
                                          ("SGLANG_VERSION", "sglang")])
def test_versions_agree_with_pyproject_and_ci_pins(key, package):
    version = _versions()[key]
    requirement = _pyproject_requirements()[package]
    assert requirement.specifier.contains(Version(version)), f"{key}={version} outside pyproject's {requirement}"
    ci = _ci_pins().get(package)
    if ci is not None:
        assert ci == version, f"{key}={version} but tests/requirements-ci.txt pins {package}=={ci}"


def test_python_version_matches_pyproject():
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(requires).contains(Version(_versions()["PYTHON_VERSION"]))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_args_come_from_versions_env_and_copies_exist(dockerfile):
    text = dockerfile.read_text()
    # An ARG with a default of its own (the base image, the torch index) is a knob, not a version.
    args = set(re.findall(r"^ARG (\w+)$", text, flags=re.M))
    assert args <= set(_versions()), f"ARGs not in docker/versions.env: {args - set(_versions())}"
    assert not re.search(r"==\s*\d", text.replace("==${", "")), "a version is written in the Dockerfile itself"
    ignored = (REPO / ".dockerignore").read_text().split()
    for line in re.findall(r"^COPY (.+)$", text, flags=re.M):
        parts = [p for p in line.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY source {source} does not exist"
            assert source.rstrip("/") not in ignored, f"{dockerfile.name}: COPY source {source} is in .dockerignore"


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.gpu", "Dockerfile.cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_declared_arg_is_used(dockerfile):
    text = dockerfile.read_text()
    unused = [arg for arg in re.findall(r"^ARG (\w+)", text, flags=re.M) if not re.search(r"\$\{" + arg + r"[}:]", text)]
    assert not unused, f"{dockerfile.name} declares ARGs it never uses: {unused}"


def test_gpu_image_installs_and_asserts_the_declared_transformer_engine():
    text = (REPO / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r'pip install [^\n]*"transformer-engine\[[^\]]*pytorch[^\]]*\]==\$\{TRANSFORMER_ENGINE_VERSION\}"', text), \
        "Dockerfile.gpu does not pip install transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}"
    assert "te.__version__.startswith('${TRANSFORMER_ENGINE_VERSION}')" in text, \
        "Dockerfile.gpu does not check that the installed Transformer Engine is the declared version"


def test_ngc_tag_is_a_release_tag():
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", _versions()["NGC_PYTORCH_TAG"]), _versions()["NGC_PYTORCH_TAG"]


def test_gpu_tier_script_reads_its_versions_from_versions_env():
    text = (REPO / "tests" / "gpu" / "run.sh").read_text()
    for key in ("TRANSFORMER_ENGINE_VERSION", "SGLANG_VERSION"):
        assert f"version_of {key}" in text, f"tests/gpu/run.sh does not read {key} from docker/versions.env"
    assert not re.search(r"==\s*\d", text), "a version is written in tests/gpu/run.sh itself"


def test_container_bases_are_build_args_defaulting_to_what_users_pull():
    cpu = (REPO / "docker" / "Dockerfile.cpu").read_text()
    gpu = (REPO / "docker" / "Dockerfile.gpu").read_text()
    assert "ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm\nFROM ${BASE_IMAGE}" in cpu
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}\nFROM ${BASE_IMAGE}" in gpu
    assert "ARG TORCH_EXTRA_INDEX=https://download.pytorch.org/whl/cpu" in cpu


def test_container_gpu_image_has_one_torch_one_nccl_and_sglang_outside_the_constraint_file():
    """One torch version everywhere: versions.env, tests/requirements-ci.txt, the README's pinned stack, the CPU
    image, and in the GPU image both the trainer's Python and the SGLang venv; the SGLang venv installs with
    PIP_CONSTRAINT unset; the NCCL step prints both sides' versions and fails the build when they differ."""
    torch = _versions()["TORCH_VERSION"]
    assert _ci_pins()["torch"] == torch
    readme = (REPO / "README.md").read_text()
    assert f"torch {torch}" in readme, f"README does not name torch {torch}"
    assert not set(re.findall(r"torch (\d+\.\d+\.\d+)", readme)) - {torch}, "README names another torch version"
    gpu = (REPO / "docker" / "Dockerfile.gpu").read_text()
    runs = re.split(r"^RUN ", gpu, flags=re.M)[1:]
    sglang = [r for r in runs if "/opt/sglang/bin/pip install" in r and "sglang[all]" in r]
    assert len(sglang) == 1 and re.search(r'PIP_CONSTRAINT= /opt/sglang/bin/pip install "sglang\[all\]==\$\{SGLANG_VERSION\}" '
                                          r'"torch==\$\{TORCH_VERSION\}"', sglang[0]), sglang
    trainer = [r for r in runs if re.search(r'(?<!/)\bpip install "torch==\$\{TORCH_VERSION\}"', r)]
    assert trainer and "/etc/pip/constraint.txt" in trainer[0] and "torch.__version__" in trainer[0], \
        "the GPU image's trainer Python does not install (and assert) torch==${TORCH_VERSION}"
    assert gpu.index(trainer[0]) < gpu.index("transformer-engine["), "TE must compile against the final torch"
    nccl = [r for r in runs if "torch.cuda.nccl.version()" in r]
    assert len(nccl) == 1 and 'echo "NCCL: trainer' in nccl[0] and "${engine_nccl}" in nccl[0]
    assert 'test "${trainer_nccl}" = "${engine_nccl}"' in nccl[0] and "check_one_nccl" in nccl[0]
    assert "ENV MPO_PYTHON=python MPO_ENGINE_PYTHON=/opt/sglang/bin/python" in gpu


def test_container_slurm_docs_run_the_image_with_pyxis_and_apptainer():
    readme = (REPO / "slurm" / "README.md").read_text()
    sbatch = (REPO / "slurm" / "train.sbatch").read_text()
    assert "MPO_CONTAINER_IMAGE=" in readme and "srun --container-image" in readme, "no pyxis example"
    assert "MPO_APPTAINER_IMAGE=" in readme and "apptainer build" in readme, "no Apptainer example"
    assert "MPO_ENGINE_PYTHON" in readme and "MPO_ENGINE_PYTHON" in sbatch
    examples = [line for line in sbatch.splitlines() if line.startswith("#") and "MPO_OVERRIDES=\"model.hf_dir" in line]
    assert examples and all("model.mcore_dir=" in line for line in examples), examples
    assert all("model.mcore_dir=" in block for block in readme.split("```")[1::2] if "sbatch slurm/train.sbatch" in block
               and "hf_dir" in block)


def test_container_pip_configuration_is_mounted_into_the_build_not_written_into_it(tmp_path):
    """docker/pip_build_config.py as docker/test.sh runs it: this machine's pip settings (files and PIP_* variables)
    become one pip.conf mounted at /etc/pip.conf, and the local paths they name are mounted read-only at the same
    paths (a file:// index with the folder above it, where its links point)."""
    index = tmp_path / "mirror" / "simple"
    index.mkdir(parents=True)
    cert = tmp_path / "ca.pem"
    cert.write_text("not a real certificate\n")
    conf = tmp_path / "user.conf"
    conf.write_text(f"[global]\nextra-index-url = file://{index}\ntimeout = 60\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": str(conf), "PIP_CERT": str(cert), "PIP_DEFAULT_TIMEOUT": "33"}
    result = subprocess.run([sys.executable, str(REPO / "docker" / "pip_build_config.py"), str(out)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    mounts = result.stdout.split()
    assert f"--volume={out / 'pip.conf'}:/etc/pip.conf:ro" in mounts
    assert f"--volume={cert}:{cert}:ro" in mounts and f"--volume={index.parent}:{index.parent}:ro" in mounts
    written = (out / "pip.conf").read_text()
    assert f"cert = {cert}" in written and "default-timeout = 33" in written and "timeout = 60" in written
    assert f"extra-index-url = file://{index}" in written


def test_container_build_without_docker_or_podman_says_what_to_install(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sed"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    result = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "cpu"], capture_output=True, text=True,
                            env={"PATH": str(bin_dir)}, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "neither docker nor podman" in lines[0] and "install" in lines[0], result.stderr


def test_container_ci_builds_and_runs_the_cpu_image():
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash docker/test.sh" in ci and "bash tests/run.sh" in ci
    test_sh = (REPO / "docker" / "test.sh").read_text()
    assert 'echo "container image_mb=$image_mb build_s=$build_s $(tail -1' in test_sh
    check = (REPO / "docker" / "in_container_check.sh").read_text()
    assert 'echo "demo_exact_first=$first demo_exact_last=$last tests_passed=$passed"' in check
    assert "mpo.cli demo" in check and ">= 0.8" in check
