"""The conformance sweep: every causal-LM type transformers registers, shrunk, under every strategy of the registry.

For each ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: its own default config rebuilt with
small sizes (width 64, 2 layers, 4 heads, a 512-token vocabulary, 4 experts where it routes), written as a
``config.json``; skipped with the reason when it is an encoder-decoder or a composite model (a vision or audio
tower around a text decoder), or when the config cannot be built. Then one preset with every strategy runs:

- ``--dry-run`` (the default): the model check and every run's judgement before the start. A cell reads "✓ judged"
  (it would start), "left out: <reason>" (refused before anything starts), or the whole preset's one-line error;
- ``--real``: the same preset run for real (2 ranks, 4 for tensor parallelism; a few steps, fp32, parity on):
  "✓" (parity with DDP), "left out: reason", or "failed: <the run's reason>".

The rule is zero "failed": a combination runs at parity or is refused before the start. It writes
``docs/architectures.md`` (``--out``): the matrix, transformers' version, the date and the commit.

    python benchmarks/architectures.py [--real] [--families gpt2,gpt_neox,...] [--out docs/architectures.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = [("ddp", "ddp", {}, 2), ("fsdp1", "fsdp1", {}, 2), ("fsdp2", "fsdp2", {}, 2),
        ("handwritten", "fsdp-handwritten", {}, 2), ("zero1", "deepspeed-zero1", {}, 2),
        ("zero3", "deepspeed-zero3", {}, 2), ("fsdp2-tp", "fsdp2-tp", {"tp": 2}, 4),
        ("autotp", "deepspeed-autotp", {"tp": 2}, 4), ("1f1b", "pp-1f1b", {"pp": 2, "microbatches": 2}, 2)]
SMALL = {  # every spelling transformers' configs use for a size, shrunk
    64: ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "word_embed_proj_dim"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    4: ("num_attention_heads", "n_head", "num_heads", "n_heads", "num_local_experts", "num_experts", "n_routed_experts"),
    128: ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "moe_intermediate_size"),
    512: ("vocab_size",),
    256: ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
    16: ("head_dim", "kv_channels", "state_size", "d_state"),
}


# Sizes that must shrink beside the width (each set only when the default is larger): key/value heads, rotary and
# latent-attention widths that must fit a 16-wide head, the dense layers before the routed ones.
SHRUNK_TOO = {"num_key_value_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2, "rotary_dim": 8,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32,
              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_shared_experts": 1,
              "n_shared_experts": 1, "shared_expert_intermediate_size": 128, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}


def tiny_config(model_type: str) -> tuple[dict | None, str]:
    """(config values, "") for ``model_type`` shrunk, or (None, why it is skipped)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as err:  # noqa: BLE001 - a config transformers cannot build with its defaults
        return None, f"its default config does not build ({type(err).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        return None, "encoder-decoder"
    if getattr(config, "sub_configs", None):
        return None, f"composite ({', '.join(sorted(config.sub_configs))})"
    values = config.to_dict()
    depth = next((values[k] for k in SMALL[2] if isinstance(values.get(k), int)), 0)
    for size, keys in SMALL.items():
        for key in keys:
            if isinstance(values.get(key), int) and not isinstance(values.get(key), bool):
                values[key] = size
    for key, size in SHRUNK_TOO.items():
        if isinstance(values.get(key), int) and not isinstance(values.get(key), bool) and values[key] > size:
            values[key] = size
    if isinstance(values.get("num_experts_per_tok"), int):
        values["num_experts_per_tok"] = 2
    for key, value in list(values.items()):  # per-layer lists follow the depth (layer types, per-layer sizes)
        if isinstance(value, list) and value and depth and len(value) == depth:
            values[key] = value[:2]
    values["model_type"] = model_type
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    values.pop("auto_map", None)
    return values, ""


def preset(path: Path, real: bool) -> str:
    """Every strategy on the model at ``path``."""
    lines = ["steps = 3" if real else "steps = 2", "global_batch = 8", "world_size = 2", 'precision = "fp32"',
             "parity = true", "loss_tolerance = 1e-4", "warmup_steps = 1", "stall_timeout_s = 240", "",
             "[model]", 'kind = "hf"', f'path = "{path}"', "seq_len = 32"]
    for name, strategy, options, ws in RUNS:
        lines += ["", "[[runs]]", f'name = "{name}"', f'strategy = "{strategy}"', f"world_size = {ws}"]
        if options:
            lines.append("options = { " + ", ".join(f"{k} = {v}" for k, v in options.items()) + " }")
    return "\n".join(lines) + "\n"


def judge(model_type: str, work: Path, real: bool) -> dict[str, str]:
    """{run: cell} for one family (or {"*": why} when it is skipped or the preset fails as a whole)."""
    values, skipped = tiny_config(model_type)
    if values is None:
        return {"*": f"skipped: {skipped}"}
    folder = work / model_type
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values, default=str), encoding="utf-8")
    (folder / "p.toml").write_text(preset(folder, real), encoding="utf-8")
    args = [sys.executable, "-m", "shardscope.cli", "run", "--preset", str(folder / "p.toml")]
    args += ["--headless", "--out", str(folder / "run")] if real else ["--dry-run"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=folder, timeout=1800)
    cells: dict[str, str] = {}
    for line in (proc.stdout + "\n" + proc.stderr).splitlines():
        if "left out:" in line and "note: run " in line and line.split("run ", 1)[-1].split(" ", 1)[0] in {r[0] for r in RUNS}:
            name = line.split("note: run ", 1)[1].split(" ", 1)[0]
            reason = line.split(" left out: ", 1)[1].split(": ", 1)[-1].strip()
            cells[name] = "left out: " + reason.replace(f"model.path = '{folder}': ", "")
    if proc.returncode == 2 and not real:
        error = next((ln for ln in proc.stderr.splitlines() if "error:" in ln), proc.stderr.strip()[-300:])
        error = error.split("error: ", 1)[-1].replace(f"{folder / 'p.toml'}: ", "").replace(f"model.path = '{folder}': ", "")
        return {"*": "refused: " + error[:300]}
    summary = folder / "run" / "summary.json"
    runs = {r.get("name"): r for r in json.loads(summary.read_text())["runs"]} if real and summary.exists() else {}
    for name, *_ in RUNS:
        if name in cells:
            continue
        if not real:
            cells[name] = "✓ judged" if proc.returncode == 0 else f"failed: exit {proc.returncode}"
            continue
        run = runs.get(name) or {}
        status = run.get("status", "missing")
        parity = run.get("parity") or {}
        ok = status == "ok" and parity.get("within_tolerance", True) is not False
        cells[name] = "✓" if ok else f"failed: {status} {str(run.get('reason') or '')[:120]}".strip()
    return cells


def markdown(results: dict[str, dict[str, str]], real: bool) -> str:
    """The matrix as docs/architectures.md."""
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    names = [r[0] for r in RUNS]
    failed = sum(1 for cells in results.values() for c in cells.values() if c.startswith("failed"))
    lines = ["# Which architectures each strategy runs", "",
             f"Made by `python benchmarks/architectures.py{' --real' if real else ''}` on "
             f"{datetime.date.today().isoformat()}, commit {commit}, transformers {transformers.__version__}, "
             f"{platform.machine()} ({os.cpu_count()} cores, CPU, gloo). Each family is transformers' own default "
             "config shrunk (width 64, 2 layers, 4 heads, vocabulary 512, 4 experts where it routes).", "",
             ("Cells: ✓ ran at parity with DDP; " if real else "Cells: ✓ judged: the model check passed and the run "
              "would start (this sweep ran `--dry-run`); ") + "left out: refused before the start, with the reason; "
             f"failed: after the start. **{failed} failed.**", "",
             "| model_type | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    notes: dict[str, int] = {}
    for family, cells in sorted(results.items()):
        if "*" in cells:
            lines.append(f"| {family} | " + cells["*"].replace("|", "/") + " |" + " |" * (len(names) - 1))
            continue
        row = []
        for name in names:
            cell = cells.get(name, "?")
            if cell.startswith(("left out", "failed")) and len(cell) > 40:
                notes.setdefault(cell, len(notes) + 1)
                cell = f"{cell.split(':')[0]} [{notes[cell]}]"
            row.append(cell.replace("|", "/"))
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    if notes:
        lines += ["", "Reasons:", ""] + [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run the sweep, print each family's line, write the matrix."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="run every strategy for real, not --dry-run")
    parser.add_argument("--families", default="", help="comma-separated model types (default: every one)")
    parser.add_argument("--out", default=str(REPO / "docs" / "architectures.md"))
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, family in enumerate(families, 1):
            results[family] = judge(family, Path(tmp), args.real)
            cells = results[family]
            print(f"[{i}/{len(families)}] {family}: " + "; ".join(f"{k} {v[:60]}" for k, v in cells.items()), flush=True)
            # written after each family: a sweep cut short still leaves the families it judged
            done = "" if i == len(families) else f"\n(Sweep in progress: {i} of {len(families)} families judged.)\n"
            Path(args.out).write_text(markdown(results, args.real) + done, encoding="utf-8")
    failed = sum(1 for cells in results.values() for c in cells.values() if c.startswith("failed"))
    print(f"architectures_failed: {failed}; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
