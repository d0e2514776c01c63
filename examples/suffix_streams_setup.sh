#!/usr/bin/env bash
# Optional set-up of examples/suffix_streams.py: build SuffixDecoding's C++ core (csrc/suffix_decoding of the
# arctic-inference 0.3.0 sdist, Apache-2.0; nanobind + CMake, CPU only) into BUILD_DIR, for the benchmark to load as
# the peer. Never a dependency of the package: the benchmark skips the peer when this was not run or failed.
#   bash examples/suffix_streams_setup.sh [BUILD_DIR]   (default /work/venvs/arctic-src; needs cmake and a C++20 g++)
set -euo pipefail
BUILD_DIR=${1:-/work/venvs/arctic-src}
PYTHON=${PYTHON:-python3}
mkdir -p "$BUILD_DIR" && cd "$BUILD_DIR"
[ -x build-venv/bin/python ] || "$PYTHON" -m venv build-venv
build-venv/bin/pip install -q nanobind   # the build tool only, in its own venv
[ -f arctic_inference-0.3.0.tar.gz ] || build-venv/bin/pip download -q --no-deps --no-binary arctic-inference arctic-inference==0.3.0
[ -d arctic_inference-0.3.0 ] || tar xzf arctic_inference-0.3.0.tar.gz
cd arctic_inference-0.3.0 && mkdir -p build && cd build
# the module must match the benchmark's Python (here 3.11): build against the same minor version
cmake ../csrc/suffix_decoding -DPython_EXECUTABLE="$BUILD_DIR/build-venv/bin/python" -DCMAKE_BUILD_TYPE=Release >cmake.log
make -j"${JOBS:-$(nproc)}" >make.log
cp _C.*.so ../arctic_inference/suffix_decoding/
echo "built: $BUILD_DIR/arctic_inference-0.3.0 (pass --peer_path to examples/suffix_streams.py)"
