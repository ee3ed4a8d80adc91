"""Export random-weight pairs of real shapes under /usr/bin/time -v: peak RSS, time per step, output size.

    python scripts/scale_check.py --shape qwen3-0.6b --modes fp32,int4 --json docs/results/scale_check.json
    python scripts/scale_check.py --shape qwen3-8b --modes int4,fp16 --max-rss-gib 20

See dflash2/bench/scalecheck.py (the shapes, the streamed checkpoint writer, the watchdog) and docs/scale.md.
"""

import sys

from dflash2.bench.scalecheck import main

if __name__ == "__main__":
    sys.exit(main())
