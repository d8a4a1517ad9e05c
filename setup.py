"""Builds the optional compiled kernels: the id index's lookup (``zps.store._probe``),
an embedding table's pull and push (``zps.store._kernel``) and more below.

Everything else is in pyproject.toml.  The extensions are optional: where one cannot be
built (no compiler or no Python headers), the install goes on and zps uses the numpy
version of the same work (``zps.store.index``, ``zps.store.tables``), which gives the
same results.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def pyzmq_libzmq() -> tuple[list[str], str] | None:
    """pyzmq's include directories and the shared libzmq it ships (``pyzmq.libs``, the
    library its backend module is linked with), or None: pyzmq is not importable here, or
    it ships no shared libzmq of its own (built against another libzmq, or with libzmq
    linked in)."""
    try:
        import zmq
    except ImportError:
        return None
    package = Path(zmq.__file__).resolve().parent
    for folder in [*map(Path, zmq.get_library_dirs()), package.parent / "pyzmq.libs"]:
        found = sorted(folder.glob("libzmq*.so*"))
        if found:
            return list(zmq.get_includes()), str(found[0])
    return None


def libzmq_extensions() -> list[Extension]:
    """The compiled code that drives pyzmq's own sockets, in Cython against pyzmq's
    published declarations (``from zmq.backend.cython.libzmq cimport ...``), linked with
    the libzmq pyzmq ships by its soname and with no search path of their own: the only
    libzmq the dynamic linker can give them is the one ``import zmq`` loaded, the instance
    pyzmq's sockets run on (zps imports zmq first).  Optional like the rest: without
    Cython, or without a libzmq shipped by pyzmq, they are not built and pyzmq does the
    work (docs/design.md, "Compiled code that drives libzmq")."""
    found = pyzmq_libzmq()
    if found is None:
        print("zps: pyzmq ships no libzmq here: pyzmq sends and receives", file=sys.stderr)
        return []
    includes, library = found
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("zps: Cython is not installed: pyzmq sends and receives", file=sys.stderr)
        return []
    common = dict(
        # A zmq.h pyzmq ships comes first; libzmq's own header otherwise (third_party/).
        include_dirs=[*includes, str(HERE / "third_party" / "libzmq" / "include")],
        extra_compile_args=["-O3"],
        extra_link_args=[library],  # recorded by its soname (DT_NEEDED), not its path
        optional=True,
    )
    extensions = [
        # A channel's send and receive of one message as one call each (zps.transport).
        Extension("zps._zmqio", ["zps/_zmqio.pyx"], **common),
        # The broker's forwarding step (zps.broker.forward).
        Extension("zps.broker._forward", ["zps/broker/_forward.pyx"], **common),
    ]
    try:
        built = list(cythonize(extensions, quiet=True))
    except Exception as e:  # optional: the install goes on without them
        print(f"zps: the libzmq extensions were not generated ({e})", file=sys.stderr)
        return []
    for ext in built:
        ext.optional = True  # cythonize does not carry it over
    return built


setup(
    ext_modules=[
        Extension(
            "zps.store._probe",
            ["zps/store/_probe.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # An embedding table's pull and push (zps.store.tables); optional the same way.
        # No floating-point contraction: the optimizer arithmetic must round exactly as
        # numpy's does, one operation at a time.  No errno or trap semantics (zps uses
        # neither), so sqrt and the branch-free selects vectorize; no value changes.
        Extension(
            "zps.store._kernel",
            ["zps/store/_kernel.c"],
            depends=["zps/store/_kernel_update.h"],
            extra_compile_args=[
                "-O3",
                "-ffp-contract=off",
                "-fno-math-errno",
                "-fno-trapping-math",
            ],
            optional=True,
        ),
        # The client's row routing (zps.core.rows); optional the same way.
        Extension(
            "zps.core._rows",
            ["zps/core/_rows.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        *libzmq_extensions(),
    ]
)
