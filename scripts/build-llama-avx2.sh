#!/usr/bin/env bash
# Builds llama.cpp's shared libraries without AVX-512 (AVX2, FMA, F16C only) from the sources vendored in the
# pinned llama-cpp-python sdist, so that an AVX-512 machine can stand in for an AVX2 one on the benchmark:
#
#   LLAMA_CPP_LIB_PATH="$(scripts/build-llama-avx2.sh)" ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
#       specdecode bench ...
#
# llama-cpp-python loads its libraries from $LLAMA_CPP_LIB_PATH when it is set. About 5-10 minutes on 2 cores,
# once; the libraries land in ~/.cache/specdecode/llama.cpp/avx2-lib (the path is printed).
set -euo pipefail
version=0.3.36
root="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/llama.cpp"
lib="$root/avx2-lib"
if [ -f "$lib/libllama.so" ]; then echo "$lib"; exit 0; fi
py="${PYTHON:-python3}"
work="$root/build-avx2-$version"
mkdir -p "$work"
"$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" 2>/dev/null
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
export PATH="$(dirname "$(command -v "$py")"):$PATH"  # a pip-installed cmake lands beside python
command -v cmake >/dev/null || "$py" -m pip install --quiet cmake
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
       -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
       -DGGML_AMX_BF16=OFF)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_BUILD_RPATH='$ORIGIN' >"$work/build.log" 2>&1
cmake --build "$work/build" --target llama -j "$(nproc)" >>"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
mkdir -p "$lib"
cp -P "$work"/build/bin/lib*.so* "$lib"/
rm -rf "$work"
echo "$lib"
