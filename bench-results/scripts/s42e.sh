#!/usr/bin/env bash
# Run 283 (session 42): the Triton spec pins (exact outputs on inputs chosen to be exact) on a GPU, helper 130.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 200 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread \
  -p no:cacheprovider --basetemp=/tmp/bt tests/kernels/triton/test_spec_pins.py tests/kernels/triton/test_prelude.py \
  > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  " $OUT/t.log | cut -c1-1500 | head -30
