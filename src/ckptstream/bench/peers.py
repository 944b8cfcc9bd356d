"""The fast loaders users pick instead of safetensors' own, as load systems of the benchmark.

fastsafetensors, InstantTensor and Run:ai Model Streamer read the safetensors file that
``ckptstream.save`` writes (the file of the ``ckptstream`` row: a valid safetensors file, flat
dotted tensor names); tensorizer reads its own format, written by its own serializer. Either
file is written before the clock starts: these rows time loads only. Each load uses the peer's
documented public API with the settings a user keeps (its defaults, which size its threads to the
machine), and returns a new ``{name: tensor}`` dict on the target device. The peers are imported
inside the functions: the package need not be installed for the benchmark to import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import ckptstream

from .state import State, flat_tensors

Load = Callable[[str, Any, str, int], Any]
GDS_DEVICE_NODE = "/dev/nvidia-fs0"  # GPUDirect Storage's driver; fastsafetensors checks the same node


def _cuda_index(device: str) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def write_safetensors(state: State, path: str, world: int) -> None:
    """The file the safetensors readers load: the one ``ckptstream.save`` writes for its own row."""
    ckptstream.save(state, path)


def fastsafetensors_load(path: str, like: Any, device: str, world: int) -> Any:
    """``SafeTensorsFileLoader`` -> ``copy_files_to_device`` -> ``get_tensor``: its documented
    low-level path, with GPUDirect Storage where the machine has it and its bounce-buffer reader
    (``nogds=True``) elsewhere; bounce buffers and threads at its defaults (16 MiB, 16 threads)."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    target = str(torch.device(device)) if torch.device(device).type == "cpu" else f"cuda:{_cuda_index(device)}"
    loader = SafeTensorsFileLoader(SingleGroup(), target, nogds=not os.path.exists(GDS_DEVICE_NODE))
    try:
        loader.add_filenames({0: [path]})
        files = loader.copy_files_to_device()
        try:
            # each tensor holds its share of the loaded buffer, so it outlives the close below
            return {name: files.get_tensor(name) for name in loader.get_keys()}
        finally:
            files.close()
    finally:
        loader.close()


def instanttensor_loader(buffered: bool) -> Load:
    """InstantTensor's ``safe_open(...).tensors()``: its default backend (direct I/O through
    io_uring, else libaio), or ``BackendPolicy.BUFFERED`` (through the page cache, which its
    documentation recommends when the same file is loaded again soon). Queue depth, chunk size
    and GPU buffer at its defaults."""

    def load(path: str, like: Any, device: str, world: int) -> Any:
        from instanttensor import BackendPolicy, safe_open

        backend = BackendPolicy.BUFFERED if buffered else None
        with safe_open(path, framework="pt", device=_cuda_index(device), backend=backend) as f:
            return dict(f.tensors())  # copies that own their memory (its default copy=True)

    return load


def runai_load(path: str, like: Any, device: str, world: int) -> Any:
    """Run:ai's ``SafetensorsStreamer().stream_file(path, device=...)`` and ``get_tensors()``:
    its concurrent readers fill a host buffer, each tensor then goes to the device; concurrency
    and chunk size at its defaults (16 readers of 2 MiB chunks on a file system)."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(path, device=str(torch.device(device)))
        return dict(streamer.get_tensors())  # owned by the caller (its default owned=True)


def tensorizer_save(state: State, path: str, world: int) -> None:
    """tensorizer's own format, written by its ``TensorSerializer.write_state_dict``."""
    from tensorizer import TensorSerializer

    serializer = TensorSerializer(path)
    try:
        serializer.write_state_dict(flat_tensors(state))
    finally:
        serializer.close()


def tensorizer_load(path: str, like: Any, device: str, world: int) -> Any:
    """``TensorDeserializer(path, device=...)``: every tensor loaded at once, its reader threads
    chosen by itself (8 for a local file), hashes not verified (its default)."""
    from tensorizer import TensorDeserializer

    with TensorDeserializer(path, device=device) as tensors:
        return dict(tensors)
