"""The compiled small-batch matmul (``cluster/engine/native/small_matmul.cc``) against the engine's main matmul,
or against numba's kernel of the same design (``cluster/engine/cpu_small_matmul.py``).

    python -m bench.small_matmul [--repeats 3] [--batches 1,2,4,8,16] [--context 256] [--max-rows N]
        [--against main|numba]

One engine (the ``bench.engine_throughput`` model and arguments), its linear layers switched between
sending inputs of up to ``SMALL_MATMUL_ROWS`` rows to the compiled kernel ("small") and sending every
input to the main matmul (oneDNN on packed weights: "main"), A then B within every repeat, so both see
the same machine:

- decode step time at each batch size (every sequence ``--context`` tokens in), median of 20 steps
  (batches above ``SMALL_MATMUL_ROWS`` take the main matmul on both sides: a control);
- the whole ``--workload`` (skewed-64: 64 requests at once), output tokens/s.

Prints min/median/max over the repeats and the small/main ratio of the medians. ``--max-rows`` sends inputs of
up to N rows to the kernel instead of ``SMALL_MATMUL_ROWS``: how the threshold was chosen
(``--max-rows 16 --batches 8,12,16``). ``--against numba``: the baseline side sends the same inputs to numba's
kernel instead of the main matmul (the host-built kernel replaced it as the engine's first choice).
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.ab import alternate, print_ab_table
from bench.engine_throughput import BENCH_SPEC, add_engine_args, make_engine
from bench.layer_ops import decode_step_ms, workload_tok_s
from cluster.engine import cpu_small_matmul
from cluster.engine.linear import SMALL_MATMUL_ROWS, Linear, SmallRowsMatmul
from cluster.engine.native import small_matmul
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.workloads import load_workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-rows", type=int, default=SMALL_MATMUL_ROWS, help="inputs of up to N rows take the kernel")
    ap.add_argument("--against", choices=("main", "numba"), default="main", help="the baseline side")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.model_dir, BENCH_SPEC)
    _, requests = load_workload(args.workload, BENCH_SPEC.vocab_size)
    engine = make_engine(model_dir, args, requests, prefix_caching=False)
    if not engine.small_rows_matmul:
        raise SystemExit("the compiled small-batch matmul is not in use here (see the engine's warning)")
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    small = SmallRowsMatmul(args.max_rows, small_matmul.small_rows_linear)
    baseline = SmallRowsMatmul(args.max_rows, cpu_small_matmul.small_rows_linear) if args.against == "numba" else None
    sides = {"small": small, args.against: baseline}
    batches = [int(b) for b in args.batches.split(",")]
    rows = [f"decode step, batch {b}, ms" for b in batches] + [f"{args.workload}, output tok/s"]
    print(
        f"main matmul {engine.matmul.name}; small-batch kernel up to {args.max_rows} rows; threads "
        f"{args.threads}; context {args.context}; {args.repeats} repeats, small then {args.against} in each"
    )

    def use(side: str) -> None:
        for module in linears:
            module.small = sides[side]

    def measure(rng: random.Random) -> list[float]:
        return [*(decode_step_ms(engine, rng, b, args.context) for b in batches), workload_tok_s(engine, requests)]

    workload_tok_s(engine, requests)  # untimed: the first run pays page faults that would land on one side
    results = alternate(list(sides), use, measure, rows, args.repeats)
    print_ab_table(results, rows, "small", args.against)


if __name__ == "__main__":
    main()
