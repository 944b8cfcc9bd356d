"""A description of the machine for the JSON report: CPU, memory, GPU, the file system measured,
and the versions of everything compared."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
from typing import Any


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def available_memory() -> int | None:
    return _meminfo().get("MemAvailable")


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mount_of(path: str) -> dict[str, str]:
    """The /proc/mounts entry whose mount point is the longest prefix of ``path``."""
    real = os.path.realpath(path)
    best = {"mount_point": "", "fs_type": "unknown", "source": "unknown"}
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best["mount_point"]):
                best = {"mount_point": point, "fs_type": fields[2], "source": fields[0],
                        "options": fields[3] if len(fields) > 3 else ""}
    return best


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_description(directory: str) -> dict[str, Any]:
    """The machine and the file system of ``directory``, for the JSON report."""
    import torch

    import ckptstream

    mem = _meminfo()
    usage = shutil.disk_usage(directory)
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total": mem.get("MemTotal"),
        "memory_available": mem.get("MemAvailable"),
        "kernel": platform.release(),
        "dir": directory,
        "file_system": dict(mount_of(directory), free=usage.free, size=usage.total),
        "cuda": torch.version.cuda,
        "root": os.geteuid() == 0,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "safetensors": version("safetensors"),
            "ckptstream": ckptstream.__version__,
            "matplotlib": version("matplotlib"),
        },
    }
