#!/usr/bin/env bash
# xformers and FlashInfer for a GPU machine that has no package index.
#
#   xformers 0.0.35 (one 3.3 MB wheel): its compiled ops are built for one torch and CUDA and may
#     not load beside another; its pure-Triton split-K decoding op (triton_splitKF) runs anyway.
#   FlashInfer (flashinfer-python, pure Python): nvcc compiles its kernels at first use. Of its
#     needs, `import flashinfer` and its attention kernels take only apache-tvm-ffi beyond a CUDA
#     image with torch, ninja, nvcc, cuda-bindings, einops, click, requests, tabulate, tqdm and
#     nvidia-ml-py (cuda-tile, nccl4py, nccl-extensions, nvidia-cudnn-frontend and the CUTLASS DSL
#     serve other kernel families). Its wheel (62 MB, 420 MB unpacked) carries the sources of every
#     family; this keeps its whole Python package and, of its data, the headers (its own, CUTLASS's,
#     CCCL's, spdlog's) and the top-level sources its decode and prefill modules are generated
#     from, as one xz tarball of about 12 MB.
#
# Where pip works, in the project root:   bash tools/peer_wheels.sh       (a few minutes: xz)
#   makes .whl-peers/ (git-ignored through .git/info/exclude), about 18 MB. Copy it beside the
#   checkout on the GPU machine, then there:
#     bash tools/peer_wheels.sh --install && export PYTHONPATH=/tmp/site
#   which installs into /tmp/site with `pip install --no-index --no-deps --target /tmp/site` and
#   unpacks FlashInfer there. FlashInfer compiles into ~/.cache/flashinfer on first use. FA4's pack (flash-attn-4) carries the same apache-tvm-ffi wheel: install both
#   packs into the same /tmp/site; the second install replaces the first's copy with its twin.
set -euo pipefail
VERS_XFORMERS=0.0.35 VERS_FLASHINFER=0.7.2.post1 VERS_TVM_FFI=0.1.15.post2
DIR=.whl-peers

install() {
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$DIR"/*.whl
  xz -d < "$DIR/flashinfer-$VERS_FLASHINFER.tar.xz" | tar -x -C /tmp/site
}
if [ "${1:-}" = "--install" ]; then install; exit 0; fi

PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p .git/info && { grep -qxF "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude; }
rm -rf "$DIR" && mkdir -p "$DIR"
python3 -m pip download -q --no-deps $PLAT -d "$DIR" "xformers==$VERS_XFORMERS" "apache-tvm-ffi==$VERS_TVM_FFI"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps $PLAT -d "$tmp" "flashinfer-python==$VERS_FLASHINFER"
# FlashInfer's wheel, trimmed, as a tar stream: every .py file, the dist-info (its version for
# importlib.metadata), no other files of its experimental kernels, and of flashinfer/data the
# include folders its JIT passes to nvcc (flashinfer/jit/env.py) and the top-level files of csrc
# (the attention sources and .jinja templates its decode and prefill modules are made from;
# its subfolders hold other families' kernels).
python3 - "$tmp"/flashinfer_python-*.whl > "$tmp/flashinfer.tar" <<'EOF'
import io, sys, tarfile, zipfile

DATA = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/",
        "flashinfer/data/cutlass/tools/util/include/", "flashinfer/data/cccl/cub/",
        "flashinfer/data/cccl/libcudacxx/include/", "flashinfer/data/cccl/thrust/",
        "flashinfer/data/spdlog/include/")


def keep(name: str) -> bool:
    if name.startswith("flashinfer/data/"):
        return name.startswith(DATA) or name.count("/") == 3 and name.startswith("flashinfer/data/csrc/")
    if name.startswith("flashinfer/experimental/"):
        return name.endswith(".py")
    return True


with zipfile.ZipFile(sys.argv[1]) as wheel, tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for info in wheel.infolist():
        if info.is_dir() or not keep(info.filename):
            continue
        member = tarfile.TarInfo(info.filename)
        member.size, member.mode = info.file_size, 0o644
        tar.addfile(member, io.BytesIO(wheel.read(info)))
EOF
xz -9 -T2 < "$tmp/flashinfer.tar" > "$DIR/flashinfer-$VERS_FLASHINFER.tar.xz"
du -sh "$DIR" "$DIR"/*
