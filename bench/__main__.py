"""``python -m bench``: every method side by side in one process, interleaved, on one workload
(bench/harness.py); the engine's flags are ``specmesh serve``'s."""

import argparse
import logging

from bench.harness import add_args, main
from services.cli import add_engine_args

ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
add_engine_args(ap)
add_args(ap)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
main(ap.parse_args())
