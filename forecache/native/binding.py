"""C functions as typed Python stubs, bound to a loaded library once.

A :class:`CFunctions` class lists a header's functions, each a stub marked with :func:`c_function`
(the C function's ctypes argument and result types): annotated parameters, a result type and a
one-line docstring, named as the C function less the class's ``prefix``. ``bind(lib)`` returns an
instance whose attributes are the library's own ctypes functions, their types set once and the
stub attached (``help()`` shows its docstring, ``inspect.signature`` its signature), so a call
through it costs a plain ctypes call and nothing more. llama-cpp-python's ``ctypes_function`` does
the same at import; here it waits until the library is loaded and checked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from typing import ParamSpec

    _P = ParamSpec("_P")
    _R = TypeVar("_R")

_Bound = TypeVar("_Bound", bound="CFunctions")


def c_function(argtypes: list[Any], restype: Any) -> Callable[[Callable[_P, _R]],
                                                               staticmethod[_P, _R]]:
    """Mark a stub of a :class:`CFunctions` class with its C function's ctypes types (a static
    method: the stub takes the C arguments only)."""

    def mark(stub: Callable[_P, _R]) -> staticmethod[_P, _R]:
        stub.ctypes_signature = (argtypes, restype)  # type: ignore[attr-defined]
        return staticmethod(stub)

    return mark


class CFunctions:
    """Stubs of a library's C functions (see the module's docstring); ``bind`` makes the instance
    that calls them."""

    prefix: ClassVar[str] = ""  # the C functions' names are prefix + the stubs' names

    @classmethod
    def stubs(cls) -> dict[str, Callable[..., Any]]:
        """Name -> stub of every C function the class declares."""
        return {name: attr.__func__ for name, attr in vars(cls).items()
                if isinstance(attr, staticmethod) and hasattr(attr.__func__, "ctypes_signature")}

    @classmethod
    def bind(cls: type[_Bound], lib: ctypes.CDLL) -> _Bound:
        """The stubs as ``lib``'s functions, their types set (AttributeError for one it lacks)."""
        bound = cls()
        for name, stub in cls.stubs().items():
            fn = getattr(lib, cls.prefix + name)
            fn.argtypes, fn.restype = stub.ctypes_signature  # type: ignore[attr-defined]
            fn.__doc__, fn.__wrapped__ = stub.__doc__, stub
            setattr(bound, name, fn)
        return bound
