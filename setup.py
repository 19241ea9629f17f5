"""Builds the compiled BOCD+V kernel; everything else is in pyproject.toml.

The kernel uses the plain C API and the buffer protocol, so it needs no numpy
headers at build time, only Python's (python3-dev) and a C compiler. On x86_64 Linux
it also links glibc's libmvec (libc6-dev) for 4-lane exp/log/log1p, used at run time
only where the CPU has AVX2 and FMA.
"""

import platform
import sys

from setuptools import Extension, setup

mvec = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")

setup(
    ext_modules=[
        Extension(
            "greyhound.analytics._bocdv",
            sources=["greyhound/analytics/_bocdv.c"],
            define_macros=[("GH_HAVE_MVEC", "1" if mvec else "0")],
            libraries=(["mvec"] if mvec else []) + ["m"],
            extra_compile_args=[
                "-O3", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden",
                "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2",
                # The reference's rounding: no fused multiply-adds, no fast-math
                # reassociation (see the top of _bocdv.c).
                "-ffp-contract=off", "-fno-math-errno",
            ],
            extra_link_args=["-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack"],
        )
    ],
)
