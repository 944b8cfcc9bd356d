#!/usr/bin/env bash
# ckptstream against the fast loaders and async checkpointers users pick instead, on one GPU
# machine without network, in one call of under 9 minutes:
#   1. installs the peers' wheels from .whl/ into $SITE (one pip call per wheel: one that does
#      not fit this machine is logged and the others still install);
#   2. the GPU tests of the peers (pytest -m gpu): exact bytes of each loader, the async peers;
#   3. the loads: ckptstream and every peer on the same 8 GiB GPT-like state, 3 runs each
#      (docs/benchmarks.md, "The fast loaders");
#   4. the stall benchmark: training time lost per checkpoint of a 7.88 GiB state.
# Each step has a deadline; a run stopped at its deadline still writes the rows it measured.
#
# Usage, from the repository root, with the wheels in .whl/ (docs/benchmarks.md lists them):
#   bash scripts/gpu-bench-peers.sh [all|loads|training]
# Results under $OUT (default ./gpu-bench-peers-out): setup.log, table-8gib-peers.txt/.json,
# bench-loads.log, table-stall-peers.txt/.json, bench-training.log.
set -u

PART=${1:-all}
OUT=${OUT:-$PWD/gpu-bench-peers-out}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-.whl}
END=${END:-525}              # seconds after the start by which everything has ended (under 9 minutes)
LOADS_END=${LOADS_END:-385}  # ... and the loads, in "all" (the stall benchmark gets the rest)
# safetensors last: of these the slowest to run, and measured in the earlier tables too
LOADS_SYSTEMS=(ckptstream fastsafetensors instanttensor runai-streamer tensorizer safetensors)
# ckptstream's default load only (load_into and checksum=False are in the earlier tables): minutes saved
LOADS_VARIANTS=(ckptstream fastsafetensors instanttensor "instanttensor buffered" runai-streamer tensorizer safetensors)
TRAINING_SYSTEMS=(device host manager.device nvrx.async_save dcp.async_save+pinned)
TRAINING_STEPS=${TRAINING_STEPS:-200}  # about 12 s of this loop's 58 ms steps: past DCP's pinned write (9 s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

log() { echo "[$(printf '%3d' "$SECONDS") s] $*" | tee -a "$OUT/setup.log" >&2; }

# run SECONDS_LEFT CMD...: CMD, interrupted (as Ctrl-C: it then reports what it measured) at the
# deadline, killed 25 s later
until_deadline() {
    local left=$1
    shift
    if (( left < 20 )); then
        log "skipped (no time left): $*"
        return 124
    fi
    timeout -s INT -k 25 "$left" "$@"
}

install_wheels() {
    log "installing the peers' wheels from $WHEELS into $SITE"
    local name wheel
    for name in crc32c fastsafetensors instanttensor runai_model_streamer tensorizer boto3 botocore s3transfer \
                jmespath redis libnacl nvidia_resiliency_ext; do
        for wheel in "$WHEELS/$name"-*.whl; do
            [[ -e $wheel ]] || { log "no wheel for $name in $WHEELS"; continue; }
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "$wheel" >>"$OUT/setup.log" 2>&1 || log "could not install $wheel (see above)"
        done
    done
    python3 - >>"$OUT/setup.log" 2>&1 <<'EOF'
import importlib, importlib.metadata, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "glibc", platform.libc_ver())
for dist, module in [("crc32c", "crc32c"), ("fastsafetensors", "fastsafetensors"), ("instanttensor", "instanttensor"),
                     ("runai-model-streamer", "runai_model_streamer"), ("tensorizer", "tensorizer"),
                     ("nvidia-resiliency-ext", "nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt"),
                     ("safetensors", "safetensors")]:
    try:
        importlib.import_module(module)
        print(f"{dist} {importlib.metadata.version(dist)}: imports")
    except Exception as e:
        print(f"{dist}: does not import: {type(e).__name__}: {e}")
EOF
    log "$(grep -c ': imports' "$OUT/setup.log") of 7 packages import (setup.log)"
}

# fastsafetensors opens the CUDA runtime as "libcudart.so", which a machine with only the
# versioned library (torch's wheels, a runtime image) lacks: point it at the versioned one
find_cudart() {
    python3 -c 'import ctypes; ctypes.CDLL("libcudart.so")' 2>/dev/null && return
    local lib
    lib=$(python3 - <<'EOF'
import glob, os, sys
roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"] + [
    os.path.join(p, "nvidia") for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
found = sorted(f for r in roots for f in glob.glob(os.path.join(r, "**", "libcudart.so.*"), recursive=True))
print(found[-1] if found else "")
EOF
)
    if [[ -z $lib ]]; then
        log "no libcudart.so.* found: fastsafetensors will say it finds no GPU runtime"
        return
    fi
    mkdir -p /tmp/cudart && ln -sf "$lib" /tmp/cudart/libcudart.so
    export LD_LIBRARY_PATH="/tmp/cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "libcudart.so -> $lib (for fastsafetensors)"
}

gpu_tests() {
    log "GPU tests of the peers"
    until_deadline 75 python3 -m pytest -q -m gpu -p no:randomly -p no:cacheprovider -rs \
        tests/test_bench_peers.py tests/test_bench_training.py >>"$OUT/setup.log" 2>&1
    log "GPU tests: exit $? ($(tail -n 1 "$OUT/setup.log"))"
}

loads() {
    local until=$1
    log "loads: ${LOADS_SYSTEMS[*]} (deadline ${until} s)"
    until_deadline $((until - SECONDS)) python3 -m ckptstream.cli bench --device cuda --size-gib 8 --repeat 3 \
        --hot-runs 3 --threads 8 --hot-threads 16 --systems "${LOADS_SYSTEMS[@]}" --variants "${LOADS_VARIANTS[@]}" \
        --json "$OUT/table-8gib-peers.json" >"$OUT/table-8gib-peers.txt" 2>"$OUT/bench-loads.log"
    log "loads: exit $?"
}

training() {
    log "stall benchmark: ${TRAINING_SYSTEMS[*]}, $TRAINING_STEPS steps (deadline ${END} s)"
    until_deadline $((END - 25 - SECONDS)) python3 -m ckptstream.cli bench --training --device cuda --size-gib 8 \
        --repeat 1 --training-steps "$TRAINING_STEPS" --training-systems "${TRAINING_SYSTEMS[@]}" \
        --json "$OUT/table-stall-peers.json" >"$OUT/table-stall-peers.txt" 2>"$OUT/bench-training.log"
    log "stall benchmark: exit $?"
}

install_wheels
find_cudart
case $PART in
    all) gpu_tests; loads "$LOADS_END"; training ;;
    loads) loads $((END - 25)) ;;
    training) training ;;
    *) echo "usage: $0 [all|loads|training]" >&2; exit 2 ;;
esac
log "done; results in $OUT"
for table in "$OUT/table-8gib-peers.txt" "$OUT/table-stall-peers.txt"; do
    [[ -s $table ]] && { echo; cat "$table"; }
done
exit 0
