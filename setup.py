"""Builds the optional compiled kernels: the id index's lookup (``zps.store._probe``),
an embedding table's pull and push (``zps.store._kernel``) and more below.

Everything else is in pyproject.toml.  The extensions are optional: where one cannot be
built (no compiler or no Python headers), the install goes on and zps uses the numpy
version of the same work (``zps.store.index``, ``zps.store.tables``), which gives the
same results.
"""

from setuptools import Extension, setup

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
        # The broker's forwarding (zps.broker.forward); optional the same way.
        Extension(
            "zps.broker._forward",
            ["zps/broker/_forward.c"],
            depends=["zps/_libzmq.h"],
            extra_compile_args=["-O3"],
            libraries=["dl"],
            optional=True,
        ),
        # A channel's send and receive of one message as one call (zps.transport);
        # optional the same way.
        Extension(
            "zps._zmqio",
            ["zps/_zmqio.c"],
            depends=["zps/_libzmq.h"],
            extra_compile_args=["-O3"],
            libraries=["dl"],
            optional=True,
        ),
    ]
)
