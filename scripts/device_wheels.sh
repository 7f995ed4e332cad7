#!/usr/bin/env bash
# Wheels the device image lacks (it has torch 2.11 on Python 3.12, numpy, PyYAML, rich,
# packaging; not hydra-core, omegaconf, antlr4-python3-runtime, pydantic), downloaded
# here for CPython 3.12 x86-64 into .whl/ (git-ignored), to carry to the device:
#
#   scripts/device_wheels.sh
#   run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
#       && PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT")
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
rm -rf "$dest" && mkdir -p "$dest"   # one version of each: start empty
# One version of each (two of one package stop the install there); --no-deps: each
# dependency is named here. Versions: what pcpflow's CI runs (pyproject's ranges).
pkgs=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  pydantic==2.13.4
  pydantic-core==2.46.4           # the one pydantic 2.13.4 pins
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.15.0       # pydantic needs >= 4.14.1; the image's may be older
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" "${pkgs[@]}"
# omegaconf 2.3 pins antlr4-python3-runtime 4.9.*, which ships only an sdist: build its
# wheel here (pure Python, so one built on any machine installs there).
if ! ls "$dest"/antlr4_python3_runtime-*.whl >/dev/null 2>&1; then
  python3 -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
fi
ls -la "$dest"
