"""The transformers versions fastnmt's integration supports: the ``transformers`` extra's range in
pyproject.toml, both ends tested by CI (the newest release and ``.ci/lower-bounds.txt``)."""

from __future__ import annotations

try:
    import transformers
except ImportError as error:  # one line, with the fix
    raise ImportError(
        'fastnmt.integrations.transformers needs transformers: pip install "fastnmt[transformers]"'
    ) from error

# Before 5.6 the layers return tuples (5.0-5.3) and the attention modules view keys with the
# query's batch size (5.4-5.5), which packed (1, tokens) queries beside (B, L) keys break.
OLDEST = (5, 6)
NEWEST_MAJOR = 5  # transformers 6 may change the layer and cache interfaces this module patches
SUPPORTED = f">={OLDEST[0]}.{OLDEST[1]},<{NEWEST_MAJOR + 1}"


def installed() -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check() -> None:
    """One-line ImportError naming the installed version when it is outside the supported range."""
    version = installed()
    if not OLDEST <= version < (NEWEST_MAJOR + 1, 0):
        raise ImportError(
            f"fastnmt.integrations.transformers supports transformers {SUPPORTED}, found "
            f'{transformers.__version__}: pip install "transformers{SUPPORTED}"'
        )


check()
