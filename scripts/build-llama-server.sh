#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (the benchmark's llama.cpp peer: its draft-model and n-gram
# speculative modes) from the llama.cpp sources vendored in the pinned llama-cpp-python sdist, so the
# peer is the same llama.cpp the `llamacpp` backend runs. PyPI ships no Linux llama-server binary.
# About 6-8 minutes on 2 cores, once; the binary lands in ~/.cache/specdecode/llama.cpp/bin.
set -euo pipefail
version=0.3.36
root="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/llama.cpp"
bin="$root/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
py="${PYTHON:-python3}"
work="$root/build-$version"
mkdir -p "$work"
"$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
export PATH="$(dirname "$(command -v "$py")"):$PATH"  # a pip-installed cmake lands beside python
command -v cmake >/dev/null || "$py" -m pip install --quiet cmake
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
    >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; echo "cmake could not configure llama.cpp (a C/C++ compiler?): $work/build.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >>"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; echo "llama-server did not build: $work/build.log" >&2; exit 1; }
mkdir -p "$root/bin"
cp "$work/build/bin/llama-server" "$bin"
rm -rf "$work"
echo "$bin"
