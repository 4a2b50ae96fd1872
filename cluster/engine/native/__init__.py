"""C++ kernels built for this host when an engine first needs them, and loaded through ctypes.

The CPU kernels that torch's own ops run slowly on the machines we serve from (prefill and decode
attention over the paged cache, the norms, rotary and SiLU x up of a layer, the KV cache write) are
written here over GCC vectors as wide as one register of the host (``vec.h``: 16 floats with
AVX-512, 8 with AVX2, 4 otherwise) and compiled with the host's C++ compiler for the host's CPU
(``-march=native``). Each source is built once per source, header, compiler and CPU into
``SHAPESERVE_KERNEL_CACHE`` (default ``~/.cache/shapeserve/kernels``), renamed into place so replicas
starting together never load half a file, and found there by the next process (~0.4 s to build on the
2-core CI machine; a load from the cache takes milliseconds).

Their parallel loops are OpenMP regions linked against ``libgomp.so.1``, the runtime torch has
already loaded, so they run on the calling thread's OpenMP team, the same threads as the matmuls
around them, rather than starting threads that would compete with those for the cores.

Where there is no compiler or a build fails, ``load`` raises ``KernelUnavailable`` with the reason;
callers check each kernel against its torch reference when an engine starts and keep the numba or
torch path, saying why once, if anything is wrong. ``SHAPESERVE_NATIVE_KERNELS=0`` turns them all
off (as a host without a compiler would run: for A/B runs and for tests).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWITCH_ENV = "SHAPESERVE_NATIVE_KERNELS"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-std=c++17")


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded on this host; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("SHAPESERVE_KERNEL_CACHE") or Path.home() / ".cache/shapeserve/kernels")


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


@functools.lru_cache(maxsize=4)
def _version(compiler: str) -> str:
    """``compiler --version`` (asked once per process and compiler: an engine loads several kernels)."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{compiler} --version failed: {e}") from e


def load(name: str) -> ctypes.CDLL:
    """Builds ``<name>.cc`` of this directory for this host (or finds it built) and loads it.
    Raises KernelUnavailable."""
    if os.environ.get(SWITCH_ENV, "1") in ("0", "false", "no"):
        raise KernelUnavailable(f"{SWITCH_ENV}={os.environ[SWITCH_ENV]} turns them off")
    source = HERE / f"{name}.cc"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    try:
        texts = [source.read_text(), *(h.read_text() for h in sorted(HERE.glob("*.h")))]
    except OSError as e:  # an install without the sources (package data)
        raise KernelUnavailable(f"cannot read the kernel's source: {e}") from e
    key = hashlib.sha256("\0".join([*texts, compiler, _version(compiler), " ".join(FLAGS), _cpu_identity()]).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(compiler, source, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelUnavailable(f"loading {target} failed: {e}") from e


def _build(compiler: str, source: Path, target: Path) -> None:
    try:  # a cache directory that cannot be written is a reason like any other: the torch path stays
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {target.parent}: {e}") from e
    try:
        build = subprocess.run(
            [compiler, *FLAGS, "-I", str(HERE), "-o", partial, str(source)], capture_output=True, text=True, timeout=300
        )
        if build.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {build.stderr.strip()[-500:]}")
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {source.name} with {compiler} failed: {e}") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
