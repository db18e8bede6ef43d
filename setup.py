"""Builds fastnmt, and its C++ CPU kernels from csrc/ into ``fastnmt._C`` when there are any.

The extension is optional: with FASTNMT_SKIP_EXTENSION=1, no compiler, or a failed compile, the
package still installs and runs on its reference path; ``fastnmt.extension_status()`` says why.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

# What a missing compiler or a failed compile raises; the package then installs without _C.
BUILD_FAILURES = (
    CCompilerError,
    CompileError,
    ExecError,
    LinkError,
    PlatformError,
    OSError,
    RuntimeError,
    subprocess.CalledProcessError,
)

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))


def extension_build():
    """setup() keyword arguments that build fastnmt._C; {} when there is nothing to build."""
    if os.environ.get("FASTNMT_SKIP_EXTENSION") == "1" or not SOURCES:
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except BUILD_FAILURES as error:
                print(
                    f"WARNING: fastnmt._C was not built ({error}); fastnmt runs on its reference "
                    "path. Rebuild with: pip install --no-build-isolation -e .",
                    file=sys.stderr,
                )

    # The extension is compiled on the machine that runs it (pip install -e .), so it targets
    # that CPU (AVX2 / AVX-512 where present); FASTNMT_PORTABLE=1 builds for any x86-64 instead.
    target = [] if os.environ.get("FASTNMT_PORTABLE") == "1" else ["-march=native"]
    extension = CppExtension(
        "fastnmt._C",
        SOURCES,
        extra_compile_args=["-O3", "-fopenmp", *target],
        extra_link_args=["-fopenmp"],
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)},
    }


setup(**extension_build())
