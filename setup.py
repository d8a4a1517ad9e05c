"""Builds the optional compiled kernel of the id index (``zps.store._probe``).

Everything else is in pyproject.toml.  The extension is optional: where it cannot be
built (no compiler or no Python headers), the install goes on and zps uses the
numpy version of the same lookup (``zps.store.index``), which gives the same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zps.store._probe",
            ["zps/store/_probe.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
