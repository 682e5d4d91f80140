"""Build of commlib's optional C extension (csrc/shm/ -> commlib.transports._shm), the CPU fast path of the
shared-memory collectives. Everything else is in pyproject.toml.

A unity build: csrc/shm/module.c includes the other parts (wait.h, reduce.c, protocol.c, with
shm.h) so that the compiler sees one translation unit and inlines across them as in one file;
`depends` lists every part and header, so that a change to any of them rebuilds the extension.

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
            "commlib.transports._shm",
            sources=["csrc/shm/module.c"],
            depends=["csrc/shm/shm.h", "csrc/shm/wait.h", "csrc/shm/reduce.c",
                     "csrc/shm/protocol.c", "csrc/reduce_math.h", "csrc/reduce_simd.h",
                     "csrc/copy_nt.h"],
            include_dirs=["csrc"],
            extra_compile_args=_FLAGS if sys.platform != "win32" else [],
            libraries=["rt"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ],
)
