"""The Docker images cannot be built here (no Docker daemon); these checks keep them honest without building:
versions live only in docker/versions.env and agree with pyproject.toml and tests/requirements-ci.txt, every
Dockerfile ARG is provided by versions.env and used, the GPU image installs (and asserts) the Transformer Engine
version it declares, tests/gpu/run.sh takes its versions from versions.env, and every file or directory the
Dockerfiles COPY exists."""

from __future__ import annotations

import re
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
    args = set(re.findall(r"^ARG (\w+)", text, flags=re.M))
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
    unused = [arg for arg in re.findall(r"^ARG (\w+)", text, flags=re.M) if "${" + arg + "}" not in text]
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
