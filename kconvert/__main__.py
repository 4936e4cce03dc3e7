"""`python -m kconvert`: the command line."""

from kconvert.cli import main

main()



