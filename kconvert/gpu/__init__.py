"""Where compute runs and the GPU memory it may take: the device (devices), the model's
shapes and the parts a command's owners declare (shapes, parts), the plan that adds them up
(plan) and the budget it is made for, resolved once per run (budget)."""
