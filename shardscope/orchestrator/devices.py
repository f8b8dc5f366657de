"""What this machine offers: GPUs (through NVML, never torch) or CPU cores.

The orchestrator must not import torch, so GPUs are counted with nvidia-ml-py. Any NVML
failure (no driver, no GPU, a container quirk) means "no GPU": the CPU path with gloo.
"""

from __future__ import annotations

import importlib.util
import os

from shardscope.config import ConfigError, HostInfo, cpu_host


def gpu_names() -> list[str]:
    """Return the names of the GPUs NVML sees, or [] when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError and driver-library load failures alike mean "no GPU here"
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def visible_gpu_count(names: list[str]) -> int:
    """Return how many of the GPUs NVML found (``names``) CUDA_VISIBLE_DEVICES leaves visible.

    NVML is believed: without a GPU it found, the variable alone (SLURM sets ``CUDA_VISIBLE_DEVICES=0`` on a
    CPU node of a GPU allocation) counts nothing. An entry of ``-1`` hides every device after it, as in CUDA.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(names)
    entries = []
    for entry in (v.strip() for v in visible.split(",")):
        if not entry or entry == "-1":
            break
        entries.append(entry)
    return min(len(entries), len(names))


def resolve_device(requested: str) -> str:
    """Return "cuda" or "cpu" for a requested ``auto``/``cpu``/``cuda``; raises ConfigError for cuda without GPUs."""
    gpus = visible_gpu_count(gpu_names()) if requested in ("auto", "cuda") else 0
    if requested == "cuda" and gpus == 0:
        raise ConfigError("launch.device = 'cuda': no GPU found through NVML; use 'auto' or 'cpu'")
    return "cuda" if gpus else "cpu"


def host_info(device: str) -> HostInfo:
    """Return what the machine can host for ``device`` ("cpu" or "cuda")."""
    if device == "cpu":
        return cpu_host()
    names = gpu_names()
    count = visible_gpu_count(names)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    label = f"{count} GPU{'s' if count != 1 else ''}" + (f" ({names[0]})" if names else "")
    return HostInfo("cuda", count, label, has_ds)
