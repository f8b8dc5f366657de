"""How much model state does each strategy keep per rank? Measured, not modelled.

Launches every registered CPU-capable strategy under real torchrun (gloo, world size 2, fp32,
3 steps) on the same model and reads each rank-0 ``memory`` record: parameter, gradient and
optimizer bytes counted from the strategy's real local tensors (``Prepared.model_state_bytes``).
Prints each strategy's bytes and its ratio to DDP, then the DeepSpeed stages again in bf16-params
(the ZeRO paper's mixed-precision setting). Tensor-parallel strategies run tp 2 x dp 1.
DeepSpeed AutoTP only takes a Hugging Face model, so it is measured on the Qwen2 layout
against its own DDP run on that model.

    python benchmarks/memory_states.py [--d-model 256] [--layers 4] [--hf-layers 4]

Expected bytes per parameter, N ranks, fp32 (DeepSpeed 0.19 as it ships keeps a separate fp32 master
partition even when parameters are fp32, at every stage): DDP 16; ZeRO-1 4 + 4 + 12/N; ZeRO-2 4 + 16/N
(plus the whole gradients of tensors straddling a partition edge); ZeRO-3 20/N; ZeRO-3 with
shardscope's ``reuse_fp32_partitions`` fix (row ``deepspeed-zero3-reuse``), which steps the fp32
parameter partitions in place, 16/N. In bf16-params: ZeRO-1 2 + 2 + 12/N; ZeRO-2 2 + 14/N; ZeRO-3
16/N (the ZeRO paper's figures).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from _launch import assert_ok, launch, prepare, tiny_comparison  # noqa: E402
from shardscope.config import ModelSpec, RunSpec  # noqa: E402
from shardscope.core import registry  # noqa: E402


def measure(out: Path, model: ModelSpec, names: list[str], precision: str = "fp32",
            extra: tuple[RunSpec, ...] = ()) -> dict[str, dict[str, int]]:
    """Launch ``ddp``, ``names`` and ``extra`` runs on ``model`` in ``precision``; return {name: last memory
    record of rank 0}."""
    runs = [RunSpec(n, n, world_size=2, precision=precision) for n in ["ddp", *names]] + list(extra)
    comparison = tiny_comparison(runs, model=model, steps=3, global_batch=4)
    prepare(out, comparison)
    records = {}
    for run in comparison.runs:
        t0 = time.time()
        result = launch(out, comparison, run.name, timeout_s=600)
        assert_ok(result)
        records[run.name] = result.of_kind("memory")[-1]
        print(f"  measured {run.name} in {time.time() - t0:.0f}s", file=sys.stderr)
    return records


def report(title: str, records: dict[str, dict[str, int]]) -> None:
    """Print one table: bytes per kind and the ratio of total model state to DDP's."""
    base = records["ddp"]["model_state_bytes"]
    print(f"\n{title}")
    print(f"{'strategy':<18}{'params':>12}{'grads':>12}{'optim':>12}{'total':>12}{'x DDP':>8}")
    for name, r in records.items():
        print(f"{name:<18}{r['param_bytes']:>12,}{r['grad_bytes']:>12,}{r['optim_bytes']:>12,}"
              f"{r['model_state_bytes']:>12,}{r['model_state_bytes'] / base:>8.3f}")


def main() -> int:
    """Measure and print; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hf-layers", type=int, default=4)
    args = parser.parse_args()
    cpu = [n for n in registry.names() if n != "ddp" and not registry.get(n).gpu_only]
    transformer = ModelSpec(vocab_size=4096, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                            d_ff=4 * args.d_model, seq_len=32)
    hf = ModelSpec(kind="hf", hf_arch="qwen2-tiny", hf_layers=args.hf_layers, vocab_size=512, seq_len=32)
    with tempfile.TemporaryDirectory() as tmp:
        on_transformer = [n for n in cpu if "transformer" in registry.get(n).models]
        fix = RunSpec("deepspeed-zero3-reuse", "deepspeed-zero3", world_size=2,
                      options={"reuse_fp32_partitions": True})
        report(f"model-state bytes per rank, world size 2, fp32, transformer d={args.d_model} L={args.layers}",
               measure(Path(tmp) / "transformer", transformer, on_transformer, extra=(fix,)))
        zero = [n for n in on_transformer if registry.get(n).needs_deepspeed]
        report("the same in bf16-params (bf16 params/grads, fp32 master + moments; DDP keeps fp32 params)",
               measure(Path(tmp) / "bf16", transformer, zero, "bf16-params"))
        on_hf = [n for n in cpu if n not in on_transformer]
        if on_hf:
            report(f"model-state bytes per rank, world size 2, fp32, qwen2-tiny with {args.hf_layers} layers",
                   measure(Path(tmp) / "hf", hf, on_hf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
