"""`python -m dspark_sidecar` runs the dspark-sidecar command."""

import sys

from dspark_sidecar.cli import main

sys.exit(main())
