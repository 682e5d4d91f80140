"""Build of commlib's optional C extension (csrc/shm.c -> commlib._shm), the CPU fast path of the
shared-memory collectives. Everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler or Python headers) the
install still succeeds, and commlib logs why the shared-memory backend is off and uses its other
backends (commlib/backends/shm.py).
"""

import sys

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-strict-aliasing"]

setup(
    ext_modules=[
        Extension(
            "commlib._shm",
            sources=["csrc/shm.c"],
            depends=["csrc/reduce_math.h", "csrc/reduce_simd.h", "csrc/copy_nt.h"],
            include_dirs=["csrc"],
            extra_compile_args=_FLAGS if sys.platform != "win32" else [],
            libraries=["rt"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ],
)
