"""Shared fixtures: small random-weight models built once per session (no downloads)."""

from __future__ import annotations

import os
import sys

import pytest

from cluster.tools.demo_model import DemoModelSpec, write_demo_model

# Three shapes for parity with transformers: MHA + untied, GQA + tied, Qwen2 (q/k/v biases) + GQA.
PARITY_SPECS = {
    "llama-mha-untied": DemoModelSpec(num_heads=4, num_kv_heads=4, tie_word_embeddings=False, seed=1),
    "llama3-gqa-tied": DemoModelSpec(
        hidden_size=64, num_heads=8, num_kv_heads=2, tie_word_embeddings=True, llama3_rope_factor=8.0, seed=2
    ),
    "qwen2-gqa-bias": DemoModelSpec(architecture="qwen2", num_heads=4, num_kv_heads=2, num_layers=3, seed=3),
}


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the test process with pytest's status once pytest is done, without the interpreter's teardown.

    The process holds native runtimes that tear down badly: Ray's core worker and gRPC threads from the in-process
    test clusters, and two OpenMP runtimes (torch's, and the one numba's threading layer loads). On a CI-like run on
    an AVX2-only VM, all 607 tests passed and the process then died of SIGSEGV in that teardown, which failed
    ``make test``. Every test has reported and every fixture has stopped its servers by now; what is left is
    finalisation, which decides nothing."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # no session ran (--help, a usage error): the normal exit path
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(name_or_spec) -> path of a model directory, built once per session."""
    cache: dict = {}

    def build(spec: str | DemoModelSpec = "default"):
        if isinstance(spec, str):
            spec = PARITY_SPECS.get(spec, DemoModelSpec())
        if spec not in cache:
            cache[spec] = write_demo_model(tmp_path_factory.mktemp("model"), spec)
        return cache[spec]

    return build


@pytest.fixture(scope="session")
def demo_model(model_factory):
    """The default demo model directory (Llama, GQA 4:2, vocab 512)."""
    return model_factory("default")
