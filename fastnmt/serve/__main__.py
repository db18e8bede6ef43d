"""``python -m fastnmt.serve``: the command lives in fastnmt.serve.command, imported once under
its own name (code defined here would exist twice: as ``__main__`` and under the package)."""

import sys

from fastnmt.serve.command import main

if __name__ == "__main__":
    sys.exit(main())
