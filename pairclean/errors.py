"""User-facing errors: the CLI turns these into one line and exit code 2."""

from __future__ import annotations

import re


class UserError(Exception):
    """Bad input or settings the user can fix; never shown with a traceback."""


class ConfigError(UserError):
    """A bad setting, worded in the library's own terms: config field names (`batch_size`).

    `fields` lists the field names the message mentions, so that a front end can name them its
    own way: the CLI says `--batch-size`, a Python caller reads `batch_size`.
    """

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = fields

    def worded(self, name: callable) -> str:
        """The message with every field name replaced by `name(field)`."""
        text = str(self)
        for field in sorted(self.fields, key=len, reverse=True):
            text = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w-])", name(field), text)
        return text
