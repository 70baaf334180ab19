#!/usr/bin/env bash
# Creates .venv at the repository root on first use and installs torch and every workspace package
# (editable) with their test dependencies. Idempotent: re-runs only when a pyproject.toml changed.
#
#   TORCH_SPEC       torch requirement to install (default: torch==2.13.0 without a GPU, torch>=2.6 with one)
#   TORCH_INDEX_URL  index to take torch from (e.g. PyTorch's CPU wheel index where PyPI's default
#                    torch wheel would be a CUDA build)
#   PYTHON           interpreter that creates the venv (default: python3, must be >= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.bcp-setup"

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "bcp needs Python >= 3.10")'

want=$(cat pyproject.toml packages/*/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      TORCH_SPEC="torch>=2.6"
    else
      TORCH_SPEC="torch==2.13.0"
    fi
  fi
  echo "bootstrap: installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
fi

# bcp-core first: the integrations depend on it by name, and pip resolves that name against an
# editable project only when the project comes before its dependents.
editables=(-e "packages/bcp-core[test]")
for pkg in packages/*/; do
  pkg=${pkg%/}
  [ "$pkg" != packages/bcp-core ] && [ -f "$pkg/pyproject.toml" ] && editables+=(-e "$pkg[test]")
done
echo "bootstrap: installing $(( ${#editables[@]} / 2 )) workspace package(s) and test tools"
"${pip[@]}" "${editables[@]}" -e ".[test]"
echo "$want" > "$STAMP"
