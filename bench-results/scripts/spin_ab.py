"""Run 295 (session 50): `dspark-sidecar bench` with the engine process's doorbell waits spinning instead of napping
(`python spin_ab.py spin|nap <bench args>`): an A/B of whether the shim's host time after the answer is the cost of
waking a napping thread. Only this process's waits change; the sidecar it starts is the stock one."""

import sys

from dspark_sidecar.proto import doorbell

if sys.argv[1] == "spin":
    doorbell.pause = lambda idle_s, nap_s=doorbell.NAP_S: None  # poll without sleeping (holds the GIL: a probe only)

from dspark_sidecar.cli import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
