"""What ``shapeserve serve`` imports before Ray starts: its config load must not pay for torch on a CPU build (that
import was ~2 s of its start on a 2-core VM, for a device the version label already names)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.serving import config as serving_config
from cluster.serving.config import ServeConfig, cpu_only_torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("version", "cpu_only"),
    [("2.13.0+cpu", True), ("2.13.0", False), ("2.13.0+cu128", False), ("2.13.0+rocm6.4", False), (None, False)],
)
def test_cpu_only_torch_reads_the_version_label(monkeypatch, version, cpu_only):
    def fake_version(name):
        assert name == "torch"
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(serving_config.importlib.metadata, "version", fake_version)
    assert cpu_only_torch() is cpu_only
    if cpu_only:
        assert ServeConfig().resolved_device() == "cpu"


def test_a_device_named_in_the_config_is_kept(monkeypatch):
    monkeypatch.setattr(serving_config, "cpu_only_torch", lambda: pytest.fail("not asked when the device is named"))
    assert ServeConfig(device="cuda").resolved_device() == "cuda"


@pytest.mark.skipif(not cpu_only_torch(), reason="a CUDA or unlabelled torch build is asked by importing it")
def test_serve_flags_load_without_importing_torch(demo_model):
    code = (
        "import argparse, sys\n"
        "from cluster.tools.serve_cli import add_arguments, config_from_args\n"
        "parser = argparse.ArgumentParser(); add_arguments(parser)\n"
        f"config, _ = config_from_args(parser.parse_args(['--model', {str(demo_model)!r}]))\n"
        "print(config.resolved_device(), config.block_tokens, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    device, block_tokens, torch_imported = done.stdout.split()
    assert device == "cpu" and int(block_tokens) > 0
    assert torch_imported == "False"
