"""The names of a safetensors checkpoint's weight files: its index, or its one file. Standard
library only, so that what runs before torch is imported (io.early_read) shares them."""

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
