"""``python -m training trace|calibrate`` (training/traces.py)."""

import logging

from training.traces import main

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
main()
