"""User-facing errors: the CLI turns these into one line and exit code 2."""


class UserError(Exception):
    """Bad input or settings the user can fix; never shown with a traceback."""
