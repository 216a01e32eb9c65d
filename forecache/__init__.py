"""forecache: run Mixture-of-Experts GGUF models larger than GPU memory on llama.cpp."""

__version__ = "0.1.0"
