#!/usr/bin/env bash
# The GPU check: bcp's accelerator tests, then a short benchmark against the hardware's floors and
# DCP (benchmarks/gpu.py, ratios printed), on one GPU in about 4 minutes. It runs the checkout's
# sources with the interpreter that already holds a CUDA build of torch: nothing is built or
# installed into it (a .venv's CPU torch would shadow the CUDA one).
#
#   scripts/gpu_check.sh            (or: make gpu-check)
#
#   PYTHON            the interpreter with CUDA torch (default: python3)
#   GPU_CHECK_WHEELS  wheels of the modules that interpreter lacks (default: .whl/ in the checkout),
#                     installed for the check into a temporary folder on the path, and removed after
#   GPU_CHECK_ARGS    arguments for benchmarks/gpu.py (default: 6 x Linear(8192, 8192) + AdamW, 4.5 GiB)
#   GPU_CHECK_DEVICE  cpu: run the check's steps on the CPU (tests skip, figures mean nothing), to try
#                     this script on a machine without a GPU
#
# Where the interpreter's torch sees no CUDA device the check is skipped, saying so (exit 0). It
# exits 2 when a module is missing (saying which wheels to bring), 1 when a test or check failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
BUDGET_S=240
say() { printf 'gpu-check: %s\n' "$*"; }

# 1. A CUDA device that this interpreter's torch sees.
if [ "$DEVICE" != cpu ]; then
  if ! seen=$("$PYTHON" - 2>&1 <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(f"{sys.executable} has no torch")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} in {sys.executable} sees no CUDA device")
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__} in {sys.executable}")
EOF
  ); then
    say "skipped, no GPU: ${seen##*$'\n'} (on a GPU machine, PYTHON names an interpreter with CUDA torch)"
    exit 0
  fi
  say "$seen"
fi

# 2. The packages' sources, the tests' helpers and the benchmarks' on the path; what bcp and the
#    tests import beside torch, from GPU_CHECK_WHEELS where the interpreter lacks it.
ours="$(printf '%s:' "$ROOT"/packages/*/src)$ROOT/tests:$ROOT/benchmarks"
theirs="${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$ours$theirs"
export PYTHONUNBUFFERED=1
lacking() {
  "$PYTHON" - <<'EOF'
import importlib
modules = ["crc32c", "numpy", "msgpack", "tqdm", "packaging", "pluggy", "iniconfig", "pytest"]
missing = []
for name in modules:
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
print(" ".join(missing))
EOF
}
missing=$(lacking)
if [ -n "$missing" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/bcp-gpu-check.XXXXXX")
  trap 'rm -rf "$site"' EXIT
  say "installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into $site for this check"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$ours:$site$theirs"
  missing=$(lacking)
fi
if [ -n "$missing" ]; then
  version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  arch=$("$PYTHON" -c 'import platform; print(platform.machine())')
  say "$PYTHON lacks: $missing"
  cat <<EOF
On a machine with a package index, from this checkout's root (git then ignores .whl/):

  echo /.whl/ >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version $version --implementation cp \\
    --platform manylinux_2_28_$arch --platform manylinux_2_17_$arch --platform manylinux2014_$arch \\
    -d .whl $missing

then copy .whl/ into this checkout and run the check again.
EOF
  exit 2
fi

# 3. The tests: the accelerator's own, and the pipelines' logic on a simulated device. Without the
#    project's conftest, which starts storage servers these tests do not use.
tests=(tests/core/test_device_copies.py tests/core/test_chunked_copies.py)
say "tests: ${tests[*]}"
tests_rc=0
timeout 100 "$PYTHON" -m pytest -q --noconftest -p no:cacheprovider "${tests[@]}" || tests_rc=$?

# 4. The benchmark, in the time left.
if [ -n "${GPU_CHECK_ARGS:-}" ]; then
  read -r -a bench_args <<<"$GPU_CHECK_ARGS"
elif [ "$DEVICE" = cpu ]; then
  bench_args=(--device cpu --layers 2 --width 512)
else
  bench_args=()
fi
left=$((BUDGET_S - SECONDS))
say "benchmark: benchmarks/gpu.py ${bench_args[*]} (${left} s left of ${BUDGET_S} s)"
bench_rc=0
timeout "$((left > 60 ? left : 60))" "$PYTHON" benchmarks/gpu.py "${bench_args[@]}" || bench_rc=$?

verdict() { if [ "$1" = 0 ]; then echo passed; elif [ "$1" = 124 ]; then echo "cut off (over time)"; else echo "FAILED (exit $1)"; fi; }
say "tests $(verdict $tests_rc); benchmark checks $(verdict $bench_rc); ${SECONDS} s in all"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
