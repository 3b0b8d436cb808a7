#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, torchvision, pyarrow, typer, rich,
# scikit-learn, timm; it cannot reach PyPI), downloaded here for its Python (3.12 unless given),
# into benchmarks/wheels/ (git-ignored; carried with the device call, which moves at most 64 MiB
# with the working tree): benchmarks/gpu_figures.sh installs them there.
#     bash benchmarks/fetch_gpu_wheels.sh [PYTHON_VERSION] [--with-nvimgcodec]
# (28 MB; with nvImageCodec and libnvjpeg 57 MB: with the 7 MB checkout, just under the 64 MiB a call carries)
set -euo pipefail
cd "$(dirname "$0")"
version=${1:-3.12}
mkdir -p wheels
packages=(open_clip_torch webdataset braceexpand ftfy wcwidth duckdb regex pyyaml)
[[ " $* " == *" --with-nvimgcodec "* ]] && packages+=(nvidia-nvimgcodec-cu13 nvidia-nvjpeg)  # nvjpeg: its GPU decoders
pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d wheels "${packages[@]}"
du -sh wheels
