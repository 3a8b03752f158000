#!/usr/bin/env bash
# Fetches the libraries the GPU benchmark measures rope_ext against (its peers) into .peers/,
# for a GPU machine that cannot reach a package index but receives the working tree and
# carried ignored folders, 64 MiB in all. Run it where pip reaches an index, then carry
# .peers along; benchmarks/gpu_check.sh installs it there and the benchmark loads each peer
# or says why it cannot (rope_ext.benchmark.load_peers).
#
#   bash benchmarks/peers.sh          # PYTHON=... picks the interpreter (default python3)
#
# .peers/wheels      liger-kernel; flashinfer-python trimmed to its rope ops
#                    (benchmarks/trim_flashinfer.py) and apache-tvm-ffi, which its JIT and its
#                    calls go through: wheels for the GPU image's CPython 3.12 on x86-64 Linux
# .peers/flash-attn  rotary.py, flash-attn's Triton rotary kernels (flash_attn/ops/triton/
#                    rotary.py of its sdist, which imports only torch and triton; the package
#                    itself needs its compiled CUDA extension), with its LICENSE and VERSION
# .peers-cache       the downloads (the whole FlashInfer wheel, the flash-attn sdist) and the
#                    local check's files; not carried
#
# What is already there is kept. Where this interpreter has torch, the trimmed FlashInfer is
# checked here: it imports, its two ops reach their JIT build, and nvcc (if present) finds
# every header the build includes. TransformerEngine is not fetched: the script prints why.
# It prints each peer's size and the total with the repository, and fails above 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}"
LIGER=0.8.5 FLASH_ATTN=2.8.3.post2 FLASHINFER=0.7.2.post1 TVM_FFI=0.1.15.post2
LIMIT_MIB=64
PEERS=.peers CACHE=.peers-cache
mkdir -p "$PEERS/wheels" "$PEERS/flash-attn" "$CACHE/local"

have() { compgen -G "$1" > /dev/null; }
mib() {  # the size of files and folders, in MiB (KiB below 0.1 MiB)
  du -b -c "$@" | tail -1 | awk '{ if ($1 < 104858) printf "%.0f KiB", $1 / 1024
                                   else printf "%.1f MiB", $1 / 1048576 }'
}

fetch_wheel() {  # NAME==VERSION DIR: the wheel for CPython 3.12 on x86-64 Linux (the GPU image)
  echo "fetching $1"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$2" "$1"
}

have "$PEERS/wheels/liger_kernel-$LIGER-*.whl" || fetch_wheel "liger-kernel==$LIGER" "$PEERS/wheels"
have "$PEERS/wheels/apache_tvm_ffi-$TVM_FFI-*.whl" ||
  fetch_wheel "apache-tvm-ffi==$TVM_FFI" "$PEERS/wheels"

# flash-attn: only its sdist has the Triton file (its wheels are built per torch and CUDA);
# pip cannot download it without building it, so it comes from the index page directly.
sdist="$CACHE/flash_attn-$FLASH_ATTN.tar.gz"
if [ ! -s "$PEERS/flash-attn/rotary.py" ]; then
  if [ ! -s "$sdist" ]; then
    url=$(curl -fsSL "$INDEX/flash-attn/" |
      grep -o -m1 "https://[^\"]*/flash_attn-$FLASH_ATTN\.tar\.gz#sha256=[0-9a-f]*") ||
      { echo "peers.sh: $INDEX/flash-attn/ links no flash_attn-$FLASH_ATTN.tar.gz" >&2; exit 1; }
    curl -fsSL -o "$sdist.partial" "${url%%#*}"
    echo "${url##*#sha256=}  $sdist.partial" | sha256sum -c --quiet
    mv "$sdist.partial" "$sdist"
  fi
  tar -xzf "$sdist" -O "flash_attn-$FLASH_ATTN/LICENSE" > "$PEERS/flash-attn/LICENSE"
  echo "$FLASH_ATTN" > "$PEERS/flash-attn/VERSION"
  tar -xzf "$sdist" -O "flash_attn-$FLASH_ATTN/flash_attn/ops/triton/rotary.py" \
    > "$PEERS/flash-attn/rotary.py.partial"
  mv "$PEERS/flash-attn/rotary.py.partial" "$PEERS/flash-attn/rotary.py"
fi

# FlashInfer: the whole wheel stays in the cache; the trimmed one is made again when the
# trimming script changes.
trimmed="$PEERS/wheels/flashinfer_python-$FLASHINFER+rope-py3-none-any.whl"
have "$CACHE/flashinfer_python-$FLASHINFER-*.whl" ||
  fetch_wheel "flashinfer-python==$FLASHINFER" "$CACHE"
whole=$(compgen -G "$CACHE/flashinfer_python-$FLASHINFER-*.whl" | head -1)
if [ ! "$trimmed" -nt benchmarks/trim_flashinfer.py ] || [ ! "$trimmed" -nt "$whole" ]; then
  "$PY" benchmarks/trim_flashinfer.py trim "$whole" "$PEERS/wheels" > /dev/null
fi

if "$PY" -c "import torch" 2> /dev/null; then
  # apache-tvm-ffi (and, where missing, pynvml) for this interpreter, in a folder of their own.
  have "$CACHE/local/apache_tvm_ffi-$TVM_FFI-*.whl" ||
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/local" \
      "apache-tvm-ffi==$TVM_FFI"
  "$PY" -c "import pynvml" 2> /dev/null || have "$CACHE/local/nvidia_ml_py-*.whl" ||
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/local" nvidia-ml-py
  rm -rf "$CACHE/check-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \
    "$CACHE/check-site" "$trimmed" "$CACHE"/local/*.whl
  echo "trimmed FlashInfer, checked here ($("$PY" --version)):"
  PYTHONPATH="$CACHE/check-site" FLASHINFER_WORKSPACE_BASE="$PWD/$CACHE" \
    CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" "$PY" benchmarks/trim_flashinfer.py check |
    sed 's/^/  /'
else
  echo "trimmed FlashInfer: not checked here ($PY has no torch)"
fi

# TransformerEngine: its CUDA library wheel against the limit, from the index's JSON API.
te=$(curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" \
  "$INDEX/transformer-engine-cu13/" 2> /dev/null | "$PY" -c '
import json, re, sys
files = json.load(sys.stdin)["files"]
def version(f):
    return tuple(int(n) for n in re.findall(r"\d+", f["filename"].split("-")[1]))
wheel = max((f for f in files if f["filename"].endswith("x86_64.whl")), key=version)
name, size = wheel["filename"], wheel["size"]
print(f"{name}: {size / 2**20:.1f} MiB")' 2> /dev/null) ||
  te="size unknown (the index did not answer)"

echo
echo "peers carried in $PEERS (sizes as they travel):"
printf '  %-42s %9s\n' "liger-kernel $LIGER" "$(mib "$PEERS"/wheels/liger_kernel-*.whl)" \
  "flash-attn $FLASH_ATTN, rotary.py" "$(mib "$PEERS/flash-attn")" \
  "flashinfer-python $FLASHINFER, rope only" "$(mib "$trimmed")" \
  "apache-tvm-ffi $TVM_FFI (FlashInfer's)" "$(mib "$PEERS"/wheels/apache_tvm_ffi-*.whl)"
echo "  (the whole flashinfer-python wheel: $(mib "$whole"))"
echo "  TransformerEngine: not carried. Its CUDA library alone is over the $LIMIT_MIB MiB the"
echo "    GPU machine receives, and its torch binding (transformer-engine-torch) is an sdist"
echo "    to compile there. The library's newest wheel: $te."
# What travels besides: tracked files and untracked ones git does not ignore.
repo=$(git ls-files -z --cached --others --exclude-standard |
  du -b -c --files0-from=- 2> /dev/null | tail -1 | cut -f1)
peers=$(du -b -s "$PEERS" | cut -f1)
total=$((repo + peers))
awk -v r="$repo" -v p="$peers" -v t="$total" -v l="$LIMIT_MIB" 'BEGIN {
  printf "  %-42s %5.1f MiB\n  %-42s %5.1f MiB\n  %-42s %5.1f MiB of %d MiB\n",
    "peers in all", p / 1048576, "repository (what travels)", r / 1048576,
    "total", t / 1048576, l }'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "peers.sh: the repository and $PEERS come to more than $LIMIT_MIB MiB: the GPU machine" \
    "would not receive them" >&2
  exit 1
fi
