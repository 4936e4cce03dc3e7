"""Quality measurements and figures: what a pipeline does to the model (KL, top-1, layer
errors) on the trained tiny MoEs and on full-size shapes, on the CPU."""
