"""Where bytes are read and written: safetensors shards, whole files, the source checkpoint,
the output directory and its lock, and the NaN/Inf test every float byte read passes."""



