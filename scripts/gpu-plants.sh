#!/usr/bin/env bash
# The GPU-only promises the CPU suite cannot judge, each broken once in a copy of the tree: a
# `pytest -m gpu` test must fail for every plant. Run on a GPU machine from the repository root:
#   bash scripts/gpu-plants.sh
# Each plant prints the first test that failed ("caught") or "NOT CAUGHT".
set -u
root=$(pwd)
host="tests/test_host_stream_gpu.py tests/test_async.py"
async="tests/test_async.py tests/test_host_stream_gpu.py"
status=0

plant() {  # name, file, "old|||new", test files
  local name=$1 file=$2 change=$3 files=$4 dir=/tmp/ckptstream-plant-$1
  rm -rf "$dir" && mkdir -p "$dir" && cp -r "$root/src" "$root/tests" "$root/pyproject.toml" "$dir/"
  python3 - "$dir/$file" "$change" <<'PY' || { echo "$name: the code to plant is gone"; status=1; return; }
import sys
path, (old, new) = sys.argv[1], sys.argv[2].split("|||")
text = open(path).read()
assert text.count(old) == 1, f"{path}: {text.count(old)} places match"
open(path, "w").write(text.replace(old, new))
PY
  # the copy's own src first: the tests' child processes take the package from the tree they run in
  out=$(cd "$dir" && PYTHONPATH="$dir/src:$dir:${PYTHONPATH:-}" timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        -m gpu $files --timeout 120 2>&1)
  failed=$(grep -m1 '^FAILED' <<<"$out")
  if [ -n "$failed" ]; then echo "$name: caught by ${failed#FAILED }"; else echo "$name: NOT CAUGHT"; status=1; fi
  rm -rf "$dir"
}

plant guard.wait_event src/ckptstream/_checkpoint/guard.py \
  '            stream.wait_event(event)|||            pass' "$host"
plant host.wait_stream src/ckptstream/_checkpoint/capture.py \
  '        stream.wait_stream(torch.cuda.current_stream(device))  # every write queued before the call|||        pass' "$host"
plant fallback.wait_staged src/ckptstream/_checkpoint/save_async.py \
  '        handle.wait_staged()
    return handle|||        pass
    return handle' "$async"
plant snapshot.out_of_memory src/ckptstream/_checkpoint/capture.py \
  '    except torch.cuda.OutOfMemoryError:
        out.clear()|||    except ZeroDivisionError:
        out.clear()' "$async"
exit $status
