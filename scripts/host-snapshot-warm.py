"""Host-mode saves on a GPU: what the call blocks for, the first save of a process against later ones
and against one after warm_host_snapshot (a 4 GiB state of 32 CUDA tensors). Run from the
repository root on a GPU machine: python scripts/host-snapshot-warm.py (docs/training.md)."""
import os, time, torch, ckptstream
D = os.environ.get("HW_DIR", "/tmp/hostwarm"); os.makedirs(D, exist_ok=True)
state = {f"t{i:02d}": torch.randn(32 << 20, device="cuda") for i in range(32)}  # 32 x 128 MiB
n = sum(t.numel() * 4 for t in state.values())
torch.cuda.synchronize()
def one(label):
    t = time.perf_counter(); h = ckptstream.save_async(state, os.path.join(D, "c.safetensors"), mode="host")
    call = time.perf_counter() - t
    while not h.staged(): time.sleep(0.001)
    staged = time.perf_counter() - t; h.result(); durable = time.perf_counter() - t
    print(f"{label}: call returned in {call * 1e3:.1f} ms, staged {staged * 1e3:.0f} ms, durable {durable:.2f} s; "
          f"snapshot held {ckptstream.host_snapshot_bytes() / 2**30:.2f} GiB", flush=True)
print(f"state {n / 2**30:.1f} GiB on {torch.cuda.get_device_name()}", flush=True)
one("first host save of the process")
one("second (kept snapshot)")
print(f"released {ckptstream.release_host_snapshot() / 2**30:.2f} GiB", flush=True)
t = time.perf_counter(); got = ckptstream.warm_host_snapshot(state)
print(f"warm_host_snapshot: {got / 2**30:.2f} GiB in {time.perf_counter() - t:.2f} s", flush=True)
one("after warm_host_snapshot")
ckptstream.release_host_snapshot()
