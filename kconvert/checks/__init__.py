"""Checks a checkpoint must pass, shared by `kconvert audit` and every conversion's source:
structure (config vs tensors) and quantization_config vs tensors."""



