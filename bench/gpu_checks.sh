#!/usr/bin/env bash
# The standing GPU checks in one run, on a CUDA host whose python3 has torch and triton:
#
#     bash bench/gpu_checks.sh [OUT_DIR] [WORKLOAD]
#
# 1. the Triton kernel tests, natively (tests/kernels: each kernel against its torch reference, and the whole
#    engine with the Triton backend against the torch backend, both on CUDA: greedy tokens identical);
# 2. python -m bench.kernels: decode bandwidth as a fraction of a device-to-device copy, bf16 and fp16;
# 3. python -m bench.kv_transfer: the transports between two processes (nccl needs two GPUs);
# 4. python -m bench.engine_throughput --device cuda: the engine against transformers on the same GPU.
#
# Each step's output goes to OUT_DIR/<step>.txt as well as stdout; a step that fails does not stop the next.
# WORKLOAD is a workload name or file (default skewed-64; a host without ../shared/workloads passes a file).
# The host needs the engine's imports too (llguidance, safetensors, tokenizers, transformers, numba): a GPU
# image without the project installed takes them on PYTHONPATH. Figures: docs/benchmarks.md, "On an NVIDIA H200".
set -u
out=${1:-${OUT:-/tmp/gpu_checks}}
workload=${2:-skewed-64}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
    $py -c 'import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \
\"transformers\", transformers.__version__, torch.cuda.get_device_name())'; nproc"
step kernel_tests 240 "$py" -m pytest -q -p no:cacheprovider tests/kernels
step bench_kernels_bf16 90 "$py" -m bench.kernels --device cuda
step engine_bf16 180 "$py" -m bench.engine_throughput --device cuda --dtype bfloat16 --workload "$workload"
step kv_transfer 90 "$py" -m bench.kv_transfer --transports nccl gloo grpc --sizes-mb 64 256
step bench_kernels_fp16 90 "$py" -m bench.kernels --device cuda --dtype float16
