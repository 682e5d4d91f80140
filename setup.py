"""Build of commlib's optional C extensions. Everything else is in pyproject.toml.

* commlib.transports._shm (csrc/shm/): the CPU fast path of the shared-memory collectives;
* commlib.compress._codecs (csrc/compress/): the CPU fast path of the int8/int4/fp8 codecs.

Unity builds: csrc/shm/module.c includes the other parts (wait.h, reduce.c, protocol.c, with
shm.h), csrc/compress/module.c includes codecs.c (with codec_simd.h and codec_math.h), so that
the compiler sees one translation unit and inlines across them as in one file; `depends` lists
every part and header, so that a change to any of them rebuilds the extension.

The extensions are optional: where they cannot be built (no C compiler or Python headers) the
install still succeeds; commlib logs why the shared-memory backend is off and uses its other
backends (commlib/backends/shm.py), and the codecs use their torch definition
(commlib/compress/_fast.py; COMMLIB_COMPRESS_IMPL=c then raises, saying so).
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
        ),
        Extension(
            "commlib.compress._codecs",
            sources=["csrc/compress/module.c"],
            depends=["csrc/compress/codecs.c", "csrc/compress/codec_simd.h",
                     "csrc/compress/codec_math.h", "csrc/reduce_math.h", "csrc/reduce_simd.h"],
            include_dirs=["csrc"],
            extra_compile_args=_FLAGS if sys.platform != "win32" else [],
            optional=True,
        ),
    ],
)
