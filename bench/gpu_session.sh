#!/usr/bin/env bash
# The checks of issue 38 that need a GPU, in one call of a GPU session (the device tool:
# /work/.library/device/README.md), within about 8 minutes of its 15 (8.5 at most): the tests marked
# `gpu` (`make test-gpu`, with the device's own torch and torchvision), then
# `python -m bench.gpu` without and with --compile. Each step has a time limit, and
# what it measured is written into $OUT as it ends, so a step cut short keeps the rest:
#
#   figures.json        every figure so far: the tests' counts, then each bench's report
#   tests.log           the gpu-marked tests, one line each (-rA), and their failures
#   bench-eager.log, bench-compiled.log, profile-eager.txt, profile-compiled.txt,
#   timeline-eager.png, timeline-compiled.png
#
# Two parts, one here and one there:
#
#   bench/gpu_session.sh wheels
#       here, where pip reaches PyPI: the project's dependencies that the device's image
#       lacks or has too old (it has torch, torchvision, numpy, pillow, pytest, ...; its
#       pyarrow 25 cannot read back a null fixed-size list, and the daemon refuses it),
#       installed for its Python 3.12 and packed as .whl/site.tar.xz (git is told to
#       ignore .whl/: .git/info/exclude); xz, and pyarrow without its Flight, its S3
#       file system and its tests, keep it within the 64 MiB a call carries
#   run(command="bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#       there: unpacks it into /tmp/site and runs the checks (about 8 minutes)
set -uo pipefail

# What the project and its gpu-marked tests import that the device's image does not have
# (its package list: /work/.library/device/KINDS.md), at the versions of .venv here.
WHEELS="structlog orjson pydantic pydantic-core annotated-types typing-inspection
typing-extensions pydantic-settings python-dotenv prometheus-client boto3 botocore
s3transfer jmespath moto responses xmltodict flask flask-cors itsdangerous blinker
cryptography cffi pycparser py-partiql-parser obstore pyarrow py-spy"
# Seconds each step may take (the lease's 15 minutes include the machine's start).
TESTS_S=150
EAGER_S=120
COMPILED_S=200
# 3,000 are over in a second, a fifth of it the lanes' start and end: half the rate of
# 20,000 on an H200 (docs/performance.md).
IMAGES=20000

wheels() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    local pinned=() site packed=""
    for name in $WHEELS; do
        version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        pinned+=("$name${version:+==$version}")
    done
    site=$(mktemp -d)
    if .venv/bin/python -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --no-compile --target "$site" "${pinned[@]}" &&
        # What nothing of pyarrow's that the project imports loads (readelf -d: NEEDED);
        # its libraries' other names are copies in the wheel, for linking against them.
        (cd "$site/pyarrow" && rm -rf tests include src _pyarrow_cpp_tests* ./*flight* \
            ./*s3* libarrow*.so libarrow*.so.*.*) &&
        rm -rf .whl && mkdir .whl &&
        tar -C "$site" -cf - . | xz -T0 -6 >.whl/site.tar.xz; then
        packed=ok
    fi
    rm -rf "$site"
    [ "$packed" = ok ] || { echo "wheels: packing failed" >&2; return 1; }
    local size
    size=$(stat -c %s .whl/site.tar.xz)
    echo "$((size / 2**20)) MiB in .whl/site.tar.xz"
    # The device tool carries at most 64 MiB a call.
    [ "$size" -le $((64 * 2**20)) ] || { echo "wheels: over the 64 MiB a call carries" >&2; return 1; }
}

figures() {  # figures.json from what the steps have left so far
    python3 - "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
figures = {}
tests = Path("/tmp/gpu-tests.xml")
if tests.is_file():
    suite = ET.parse(tests).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    figures["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
for kind in ("eager", "compiled"):
    report = Path(f"/tmp/bench-{kind}/report.json")
    if report.is_file():
        figures[kind] = json.loads(report.read_text())
(out / "figures.json").write_text(json.dumps(figures, indent=2))
print(json.dumps({k: v for k, v in figures.items() if k == "tests"}))
EOF
}

bench() {  # bench <eager|compiled> <seconds> [flags]: one bench.gpu run and its files
    local kind=$1 limit=$2
    shift 2
    rm -rf "/tmp/bench-$kind"
    timeout --kill-after=10 "$limit" python3 -m bench.gpu --only overlap,tars,profile \
        --images "$IMAGES" --profile-batches 10 --out "/tmp/bench-$kind" "$@" \
        >"$OUT/bench-$kind.log" 2>&1
    echo "bench $kind: exit $?"
    cp "/tmp/bench-$kind/profile.txt" "$OUT/profile-$kind.txt" 2>/dev/null
    cp "/tmp/bench-$kind/timeline.png" "$OUT/timeline-$kind.png" 2>/dev/null
    figures
}

if [ "${1:-}" = wheels ]; then
    wheels
    exit
fi

OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Python's own lzma: the image need not have an xz program for tar.
python3 -m tarfile --filter data -e .whl/site.tar.xz /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD
began=$(date +%s)
python3 -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__,
    torch.cuda.get_device_name(), torch.cuda.is_available())' || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv

# The files with gpu-marked tests, so that modules the device cannot import (duckdb's)
# are not collected for nothing.
gpu_tests=$(grep -rlE 'mark\.gpu|also_on_gpu|needs_gpu' tests --include='test_*.py' | sort)
timeout --kill-after=10 "$TESTS_S" python3 -m pytest -m gpu -p no:xdist -p no:cacheprovider \
    -rA --timeout 150 --junitxml=/tmp/gpu-tests.xml $gpu_tests >"$OUT/tests.log" 2>&1
echo "tests: exit $? after $(($(date +%s) - began)) s"
figures

bench eager "$EAGER_S"
echo "after $(($(date +%s) - began)) s"
bench compiled "$COMPILED_S" --compile
echo "done after $(($(date +%s) - began)) s"
tail -n 5 "$OUT/tests.log"
grep -h '^{"' "$OUT"/bench-*.log | cut -c1-400
