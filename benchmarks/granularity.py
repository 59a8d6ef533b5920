"""How much of the gap to the ideal is integer granularity of the split, and can micro-batching remove it?

Pure arithmetic on measured solo rates (no devices needed). For a global batch of G samples split into integer
shares b_r, the compute part of a step takes max_r b_r / c_r; with fractional shares it would take G / Σ c_r. The
ratio of the two is the efficiency left after granularity alone (communication not counted).

Micro-batching runs a rank's share in pieces; the share itself stays an integer number of samples, so the split and
this bound are unchanged. What would make shares finer is splitting a whole accumulation window of A global batches
(A·G samples) at once and letting each rank spread its share over its A micro-steps: under ``no_sync`` nothing waits
between micro-steps, so only the window's total per rank matters. That is what the last column computes (A = 4).

    python benchmarks/granularity.py            # mix4 / mix2 GPT solo rates from benchmarks/RESULTS.md
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hetero.plan.split import split_batch  # noqa: E402

# Solo samples/s per emulated device (benchmarks/RESULTS.md, 2x/4x H200, GPT-2 small, 1024 tokens, bf16) and the
# measured step of the profiled split.
LABS = {
    "mix4/gpt": {"solo": [273, 271, 172, 100], "global_batch": 32, "measured_split": [11, 11, 7, 3],
                 "measured_step_ms": 57.9},
    "mix2/gpt": {"solo": [272, 100], "global_batch": 16, "measured_split": [12, 4], "measured_step_ms": 56.8},
}


def best_integer_split(g: int, rates: list[float]) -> list[int]:
    """The integer split minimising max_r b_r / c_r (greedy: each next sample to the rank that finishes it first)."""
    shares = [0] * len(rates)
    for _ in range(g):
        r = min(range(len(rates)), key=lambda q: ((shares[q] + 1) / rates[q], q))
        shares[r] += 1
    return shares


def compute_ms(split: list[int], rates: list[float]) -> float:
    return 1000 * max(b / c for b, c in zip(split, rates))


def rows() -> list[dict]:
    out = []
    for name, lab in LABS.items():
        rates, g = lab["solo"], lab["global_batch"]
        ideal = 1000 * g / sum(rates)
        proportional = split_batch(g, rates)
        best = best_integer_split(g, rates)
        window = best_integer_split(4 * g, rates)  # an accumulation window of 4 global batches split as one
        out.append({
            "lab": name, "global_batch": g, "ideal_compute_ms": ideal,
            "measured_split": lab["measured_split"],
            "measured_split_compute_ms": compute_ms(lab["measured_split"], rates),
            "proportional_split": proportional, "proportional_compute_ms": compute_ms(proportional, rates),
            "best_integer_split": best, "best_integer_compute_ms": compute_ms(best, rates),
            "granularity_efficiency": ideal / compute_ms(best, rates),
            "measured_step_ms": lab["measured_step_ms"],
            "not_compute_ms": lab["measured_step_ms"] - compute_ms(lab["measured_split"], rates),
            "window4_split": window, "window4_efficiency": 4 * ideal / compute_ms(window, rates),
        })
    return out


def main() -> None:
    result = rows()
    print("| lab | G | ideal compute ms | measured split (compute ms) | best integer split (ms) | granularity eff. "
          "| measured step ms | of which not compute | window of 4 G: eff. |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result:
        print(f"| {r['lab']} | {r['global_batch']} | {r['ideal_compute_ms']:.1f} | {r['measured_split']} "
              f"({r['measured_split_compute_ms']:.1f}) | {r['best_integer_split']} "
              f"({r['best_integer_compute_ms']:.1f}) | {r['granularity_efficiency']:.3f} | {r['measured_step_ms']} "
              f"| {r['not_compute_ms']:.1f} | {r['window4_efficiency']:.3f} |")
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "granularity.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
