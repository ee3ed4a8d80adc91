"""python -m dflash2.bench.device (what scripts/device_check.sh runs): main.py's main."""

import sys

from dflash2.bench.device.main import main

sys.exit(main())
