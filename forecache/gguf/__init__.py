"""Reading, checking, identifying and making GGUF models.

Named like gguf-py at no cost: imports are absolute, so ``import gguf`` here is the library.
"""
