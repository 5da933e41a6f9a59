"""`python -m studio`: the same as `swift-studio studio`."""
import argparse
import sys

from studio.server import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m studio", description="Start the swift-studio web UI.")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
