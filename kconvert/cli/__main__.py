"""`python -m kconvert.cli`: the command line."""

from kconvert.cli import run

run()



