"""How a model is placed: options in, a plan before the load and after it, an expert cache out."""
