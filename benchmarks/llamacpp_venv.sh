#!/usr/bin/env bash
# Build a separate virtual environment holding llama-cpp-python, compiled here from source, for the
# llama.cpp contender (benchmarks/llamacpp.py).
#
# Usage: benchmarks/llamacpp_venv.sh [VENV_DIR]     (default: <repo root>/.venv-llamacpp)
#
# The build targets AVX2/FMA/F16C (plus AVX-512 when /proc/cpuinfo reports avx512f) with GGML_NATIVE=OFF and
# every AMX option off: a -march=native build is known to crash on VMs that advertise AMX.
# Idempotent: when the venv imports llama_cpp and holds the stamp .built-<version>, nothing is done.
# Environment: PYTHON (interpreter for `-m venv`, default python3), LLAMACPP_SDIST (a local sdist of the
# same version to build instead of fetching it from the package index).
set -euo pipefail

VERSION="0.3.36"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-llamacpp}"
case "$venv" in
    /*) ;;
    *) venv="$PWD/$venv" ;;
esac
stamp="$venv/.built-$VERSION"
py="$venv/bin/python"

if [[ -f "$stamp" ]] && "$py" -c "import llama_cpp" >/dev/null 2>&1; then
    echo "llamacpp_venv: $venv already holds llama-cpp-python $VERSION; nothing to do"
    exit 0
fi

avx512=OFF
if grep -qw avx512f /proc/cpuinfo; then
    avx512=ON
fi
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
cmake_args+=" -DGGML_AVX512=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
cmake_args+=" -DGGML_OPENMP=ON"

if [[ ! -x "$py" ]]; then
    echo "llamacpp_venv: creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
rm -f "$venv"/.built-*
# A copy built with other flags (or an interrupted build) must not satisfy pip's "already installed".
"$py" -m pip uninstall -y -q llama-cpp-python >/dev/null 2>&1 || true

source_spec="llama-cpp-python==$VERSION"
if [[ -n "${LLAMACPP_SDIST:-}" ]]; then
    source_spec="$LLAMACPP_SDIST"
fi

echo "llamacpp_venv: building $source_spec with CMAKE_ARGS=\"$cmake_args\""
start=$(date +%s)
CMAKE_ARGS="$cmake_args" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$py" -m pip install --no-cache-dir --no-binary llama-cpp-python "$source_spec"
"$py" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')"
printf 'CMAKE_ARGS=%s\n' "$cmake_args" >"$stamp"
echo "llamacpp_venv: built in $(($(date +%s) - start)) s; python is $py"
