"""What runs in which order: the layer graph (`network`), its route of steps, and the packed route with micro-
batches."""
