"""The compiled extension is optional and explains itself in one line."""

import fastnmt


def test_status_is_one_line_that_says_how_to_fix():
    status = fastnmt.extension_status()
    assert "\n" not in status
    if fastnmt.extension_available():
        assert "loaded from" in status
    else:
        assert "pip install" in status
