"""Builds fastnmt, and its C++ CPU kernels from csrc/ into ``fastnmt._C`` when there are any.

The extension is optional: with FASTNMT_SKIP_EXTENSION=1, no compiler, or a failed compile, the
package still installs and runs on its reference path; ``fastnmt.extension_status()`` says why.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))


def extension_build():
    """Return setup() keyword arguments that build fastnmt._C, or {} when there is nothing to build."""
    if os.environ.get("FASTNMT_SKIP_EXTENSION") == "1" or not SOURCES:
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as error:  # noqa: BLE001 - any build failure leaves a working package
                print(
                    f"WARNING: fastnmt._C was not built ({error}); fastnmt runs on its reference "
                    "path. Rebuild with: pip install --no-build-isolation -e .",
                    file=sys.stderr,
                )

    extension = CppExtension(
        "fastnmt._C",
        SOURCES,
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)},
    }


setup(**extension_build())
