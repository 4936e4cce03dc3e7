"""`python -m kconvert`: the command line."""

from kconvert.cli import run

run()



