"""`kconvert inspect`: what a checkpoint holds and what a conversion of it would write, from
the safetensors headers and config.json alone, and how it fits on given GPUs.

`predict.py` plans the hypothetical output with the converter's own stages and work plan (no
size arithmetic of its own), `deploy.py` splits bytes over tensor/expert/pipeline parallel GPUs
and sizes the MLA KV cache, `report.py` puts it together (table and JSON)."""
