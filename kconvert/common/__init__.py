"""What every layer may use (the ground layer, beside kconvert.errors, kconvert.version
and kconvert.model): the defaults and rules of the options the command line and the Python API
share (options), a run's events (events), the torchrun process group (distributed), and
packages that are also functions of the API (callable_package)."""
