"""The one exception type the CLI turns into a clean one-line error and exit code 1."""


class LmopsError(Exception):
    """A problem the user can fix (bad params, bad data, a broken model directory)."""
