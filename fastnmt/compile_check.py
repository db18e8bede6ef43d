"""``python -m fastnmt.compile_check``: compile every Triton kernel for real GPUs without a GPU
(``fastnmt.ops.compile_check``) and print registers, shared memory, spills and wgmma per case."""

from __future__ import annotations

import os
import sys

from fastnmt.ops.compile_check import format_table, run_all


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: GPU compilation does not work under the interpreter")
        return 2
    results = run_all()
    print(format_table(results) if results else "no Triton kernels declare compile cases")
    failed = [r for r in results if r.problems]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
