#!/usr/bin/env bash
# owai's CPU tests under the torch that the lent GPU machines run (2.11.0 with triton 3.6.0: the device
# library's KINDS.md), not the pinned 2.13.0. A GPU call installs owai there with --no-deps
# (benchmarks/mmv2_gpu.sh), so code that is right on 2.13 but not on 2.11 fails that call, or is
# silently wrong in it: under 2.11's torch.compile an autograd.Function's output made by a `.to` that
# changed nothing got a zero gradient (docs/results.md, issue #39, twentieth session). Run this before
# a GPU call. It needs the package registries (PyPI's torch 2.11.0 is its CUDA build: about 3 GB of
# wheels) and no GPU, and it leaves the checkout as it found it except for owai.egg-info:
#
#     bash benchmarks/lent_torch.sh                 # the compiled paths' tests (v1, v2, the key scan, Llama, caches,
#                                                   # the Triton lowering), ~2 min
#     bash benchmarks/lent_torch.sh --all           # the whole default run (5 minutes on 2 cores, once installed)
#
# The virtual environment is kept outside the checkout ($OWAI_LENT_VENV, default
# ${XDG_CACHE_HOME:-~/.cache}/owai/lent-torch) and reused by the next run (only if it is yours and not
# writable by others: a shared /tmp would let another user plant its python). numpy stays below 2.4 there: triton 3.6's
# interpreter, which runs the key scan's kernel on the CPU, fails under numpy >= 2.4 (the lent machines
# compile that kernel for their GPU instead, so their numpy 2.5 does not matter to them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${OWAI_LENT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/owai/lent-torch}"
py="$venv/bin/python"
if [ -e "$venv" ] && { [ ! -O "$venv" ] || [ -n "$(find "$venv" -maxdepth 0 -perm /022)" ]; }; then
    echo "error: $venv is not yours or is writable by others; set OWAI_LENT_VENV to a folder of your own" >&2
    exit 2
fi
if [ ! -x "$py" ]; then
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
fi
"$py" -m pip install -q --upgrade pip "setuptools>=77,<82"
# pyproject's dependencies and test extra, read from it, with the lent machine's releases in place of the
# pins on torch, triton, numpy and transformers (the version the GPU call carries as a wheel)
mapfile -t deps < <("$py" - <<'EOF'
import re
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.match(r"[A-Za-z0-9_.-]+", requirement).group() not in ("torch", "triton", "numpy", "transformers"):
        print(requirement)
EOF
)
"$py" -m pip install -q "torch==2.11.0" "triton==3.6.0" "numpy<2.4" "transformers==5.24.0" "${deps[@]}"
"$py" -m pip install -q --no-deps --no-build-isolation -e .  # owai's pins left out, as on the lent machine
"$py" -c "import sys, numpy, torch, triton, transformers; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${1:-}" = "--all" ]; then
    exec "$py" -m pytest -q -p no:cacheprovider
fi
exec "$py" -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_memory_mosaics.py tests/test_mm_speed.py \
    tests/test_memory_mosaics_v2.py tests/test_key_scan_triton.py tests/test_llama.py tests/test_generate_cache.py \
    tests/test_triton_lowering.py tests/test_icl_prefix_cache.py
