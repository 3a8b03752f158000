#!/usr/bin/env bash
# One command for a fresh GPU host: build rope_ext for this GPU, run the CUDA tests, the GPU
# benchmarks (rotary, fused RMSNorm + RoPE, RoPE + KV-cache write, compiled decoder layers)
# and (when present) compute-sanitizer memcheck over a small test. Results go to $OUT (default
# ./gpu_results): summary.txt, build.log, tests.log (tests_full.log whole), peers.log,
# bench*.md/.csv/.json/.png, bench_layer.json, emulation_gdb.log, memcheck.log, and all of
# them in one gpu_results.tgz (a lent device machine returns 8 files at most). Sized to finish
# within 10 minutes, a device call's limit, on one H100 or H200: each stage has its own
# timeout, and the last (the prefill plot) runs only where 8 minutes have not passed.
#
# Where .peers/ came along (benchmarks/peers.sh fills it on a machine with a package index),
# its wheels are installed into a folder of their own, which the benchmarks get on PYTHONPATH,
# and FlashInfer's rope kernels JIT-compile beside the build; summary.txt says which peers
# loaded and why the others did not.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
start=$SECONDS
say() { printf '=== %s (%ds)\n' "$*" $((SECONDS - start)) | tee -a "$OUT/summary.txt"; }
status=0

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" ROPE_EXT_CUDA=1 PYTHONUNBUFFERED=1
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then  # just this GPU's arch: a faster build
  TORCH_CUDA_ARCH_LIST=$(python -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/summary.txt"
{ lscpu | grep -m1 "Model name"; echo "CXX=${CXX:-c++}: $(${CXX:-c++} --version | head -1)"; } |
  tee -a "$OUT/summary.txt"

peers_site=/tmp/rope_ext_peers
peers_jit=""
if [ -d .peers/wheels ]; then
  say "peers: install .peers/wheels, FlashInfer's rope JIT in the background"
  if python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$peers_site" .peers/wheels/*.whl > "$OUT/peers.log" 2>&1; then
    # Two nvcc jobs, on cores the build leaves; the benchmark would otherwise wait for them.
    ( PYTHONPATH="$peers_site${PYTHONPATH:+:$PYTHONPATH}" timeout 420 python -c \
        "import flashinfer.rope as r; r.get_rope_module(); print('FlashInfer rope module built')" \
        >> "$OUT/peers.log" 2>&1 ) &
    peers_jit=$!
  else
    tail -20 "$OUT/peers.log" | tee -a "$OUT/summary.txt"
    status=1
  fi
else
  echo "no .peers: no peer is measured (benchmarks/peers.sh fetches them)" |
    tee -a "$OUT/summary.txt"
fi

say "build (archs $TORCH_CUDA_ARCH_LIST)"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; say "BUILD FAILED"; exit 1; }
python -m rope_ext --no-bench 2>&1 | tee -a "$OUT/summary.txt"

say "CUDA tests"
missing=$(python - <<'PY'
import importlib.util
print(" ".join(m for m in ("pytest", "hypothesis", "mpmath", "expecttest") if importlib.util.find_spec(m) is None))
PY
)
[ -n "$missing" ] && python -m pip install -q $missing > /dev/null 2>&1
if python -c "import pytest, hypothesis, mpmath" 2>/dev/null; then
  # No -x: one failure must not hide the rest of a scarce GPU session's results.
  # Four workers where pytest-xdist is installed: the suite is many small launches.
  workers=$(python -c "import xdist" 2>/dev/null && echo "-n 4")
  timeout 240 python -X faulthandler -m pytest -q -p no:cacheprovider $workers tests/test_cuda.py \
    tests/test_build.py tests/test_apply.py tests/test_precompute.py tests/test_autograd.py \
    tests/test_compile.py tests/test_properties.py tests/test_qk_norm.py -k "cuda or test_build" \
    > "$OUT/tests_full.log" 2>&1 || status=1
  tail -40 "$OUT/tests_full.log" | tee "$OUT/tests.log"
  # Where an emulation case failed or a worker died: a backtrace. (On the H200 image the
  # emulation crashed while the extension carried a static libstdc++, which setup.py now
  # refuses.) cuda-gdb where there is no gdb: it debugs host code too.
  gdb=$(command -v gdb || command -v cuda-gdb || echo "$CUDA_HOME/bin/cuda-gdb")
  if [ -x "$gdb" ] && grep -q "emulation.*FAILED\|FAILED.*emulation\|node down" "$OUT/tests_full.log"; then
    timeout 120 "$gdb" -q -batch -ex run -ex bt --args python -m pytest -q -x -p no:cacheprovider \
      tests/test_cuda.py -k emulation > "$OUT/emulation_gdb.log" 2>&1
    grep -E "passed|failed|SIGSEGV|^#[0-9]" "$OUT/emulation_gdb.log" | head -30 | tee -a "$OUT/summary.txt"
  fi
else
  echo "pytest/hypothesis/mpmath unavailable here: CUDA tests not run" | tee "$OUT/tests.log"
  status=1
fi

if [ -d "$peers_site" ]; then
  [ -n "$peers_jit" ] && wait "$peers_jit"
  tail -1 "$OUT/peers.log" | tee -a "$OUT/summary.txt"
  export PYTHONPATH="$peers_site${PYTHONPATH:+:$PYTHONPATH}"
fi
say "peers"
python -c "from rope_ext import benchmark; print('\n'.join(benchmark.peer_report()))" 2>&1 |
  tee -a "$OUT/summary.txt"

say "GPU benchmark"
# The peers' cases: Llama-3-8B and -70B prefill and a per-sequence decode step, bf16 and float32,
# then partial rotary; forward + backward for every provider that has a backward.
timeout 240 python benchmarks/bench_rope.py --device cuda --suite core --dtypes bfloat16,float32 \
  --backward --out "$OUT/bench" 2>&1 | tail -80 | tee "$OUT/bench.log"
timeout 60 python benchmarks/bench_rope.py --device cuda --suite partial --dtypes bfloat16 \
  --backward --out "$OUT/bench_partial" 2>&1 | tail -30 | tee "$OUT/bench_partial.log"
say "GPU benchmark: fused RMSNorm + RoPE (vLLM's fused_qk_norm_rope where importable)"
# [4, 4096, 32/8, 128] and decode [64, 1]; against compiled HF Qwen3, forward and fwd+bwd.
timeout 150 python benchmarks/bench_rope.py --device cuda --suite qk_norm --dtypes bfloat16 \
  --out "$OUT/bench_qk_norm" 2>&1 | tail -50 | tee "$OUT/bench_qk_norm.log"

say "GPU benchmark: fused RoPE + KV-cache write (bf16 and float8 caches, prefill and decode)"
timeout 120 python benchmarks/bench_rope.py --device cuda --suite kv_cache --dtypes bfloat16 \
  --no-compile --out "$OUT/bench_kv_cache" 2>&1 | tail -45 | tee "$OUT/bench_kv_cache.log"

say "GPU benchmark: one compiled Llama and Qwen3 decoder layer, with and without rope_ext"
# Inductor cannot fuse across a custom op: this says whether rope_ext makes a compiled layer
# slower (bench_layer.py). Ten compiles: the stage with the most compile time.
timeout 200 python benchmarks/bench_layer.py --device cuda --out "$OUT/bench_layer.json" 2>&1 |
  grep -v Warning | tail -20 | tee "$OUT/bench_layer.log"

if command -v compute-sanitizer > /dev/null || [ -x "$CUDA_HOME/bin/compute-sanitizer" ]; then
  say "compute-sanitizer memcheck"
  cs=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
  timeout 100 "$cs" --tool memcheck --error-exitcode 1 python -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda.py -k "(agrees_with and bfloat16 and 128-128) or kv_cache_cuda_agrees" \
    > "$OUT/memcheck.log" 2>&1 ||
    status=1
  tail -5 "$OUT/memcheck.log" | tee -a "$OUT/summary.txt"
fi
if [ $((SECONDS - start)) -lt 480 ]; then  # the plot only where the session has time left
  say "GPU benchmark: prefill sweep (the plot)"
  timeout 90 python benchmarks/bench_rope.py --device cuda --suite prefill --dtypes bfloat16 \
    --no-compile --out "$OUT/bench_prefill" > /dev/null 2>&1
fi
say "done, status $status"
tar czf /tmp/gpu_results.tgz -C "$OUT" --exclude=gpu_results.tgz . && mv /tmp/gpu_results.tgz "$OUT/"
exit $status
