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


def shared_libstdcxx():
    """The link argument that puts the shared libstdc++ (the one torch runs on) into _C.

    Where the compiler's libstdc++.so development link is missing or dangling, g++ quietly links
    libstdc++.a into the extension instead. That second copy's locale is never initialised, so
    the first error message that formats a number (TORCH_CHECK(ok, "got ", value)) crashes the
    process (seen on Ubuntu 24.04, gcc 13.3, torch 2.11). Naming the runtime library's path
    resolves every libstdc++ symbol there whatever the compiler would pick; nothing when the
    compiler cannot say where it is.
    """
    compiler = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run(
            [compiler, "-print-file-name=libstdc++.so.6"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    return [found] if os.path.isabs(found) and os.path.exists(found) else []


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
        extra_link_args=["-fopenmp", *shared_libstdcxx()],
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)},
    }


setup(**extension_build())
