"""Compiles every kernel to an sm_90 cubin without a GPU (run with TRITON_INTERPRET unset).

The interpreter accepts programs the compiler rejects (dot shapes, layouts, types), so the
CPU test suite also compiles each kernel natively. Prints each kernel's register use.
    python -m tests.kernels.compile_sm90
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cluster.engine.attention.triton.decode import _decode_merge_kernel, _decode_partition_kernel
from cluster.engine.attention.triton.kv_write import _write_kv_kernel
from cluster.engine.attention.triton.prefill import _prefill_kernel

INDEX_PTRS = {
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
}
FP32_PTRS = {"part_out_ptr", "part_max_ptr", "part_sum_ptr"}


def compile_sm90(kernel, dtype: str, constexprs: dict, num_warps: int = 4):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_PTRS:
            sig[name] = INDEX_PTRS[name]
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    index = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=kernel, signature=sig, constexprs=index)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def registers(compiled) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return next((line.strip().split(" SHARED")[0] for line in out.splitlines() if "REG:" in line), "?")


def main() -> int:
    # Launch settings mirror the wrappers' choices for head_dim 128, GQA 4.
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        dot = dict(DOT_UPCAST=False, DOT_PRECISION=precision)
        jobs = [
            (_write_kv_kernel, dict(BLOCK_SIZE=16, KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), 4),
            *(
                (
                    _decode_partition_kernel,
                    dict(
                        BLOCK_SIZE=16,
                        GROUP=4,
                        HEAD_DIM=128,
                        BLOCK_G=16,
                        BLOCK_D=128,
                        TILE_N=32,
                        PARTITION_SIZE=1024,
                        SINGLE_PARTITION=single,
                        **dot,
                    ),
                    8 if dtype == "fp32" else 4,
                )
                for single in (True, False)
            ),
            (_decode_merge_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_P=4, PARTITION_SIZE=1024), 2),
            (
                _prefill_kernel,
                dict(BLOCK_SIZE=16, GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_Q=16, BLOCK_D=128, TILE_N=32, **dot),
                8,
            ),
        ]
        for kernel, constexprs, warps in jobs:
            compiled = compile_sm90(kernel, dtype, constexprs, warps)
            print(f"{kernel.__name__} {dtype}: {registers(compiled)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
