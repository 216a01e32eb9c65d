"""forecache's version, in a module of its own: the package's ``__init__`` makes
``forecache.Llama`` (and so llama.cpp and everything a model load needs) reachable, which a
module that only wants the version string must not depend on."""

__version__ = "0.1.0"
