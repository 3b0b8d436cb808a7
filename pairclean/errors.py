"""User-facing errors: the CLI turns these into one line and exit code 2.

The library words its settings as config field names (`batch_size`), never as command-line flags;
`word_fields` is how a front end renames them in an error (`ConfigError.worded`) or a warning
(`ops.notices.notice(message, *fields)`). A message that also holds free text (a path, a value,
the field's name as a plain word) marks the field as code: "pass `overwrite` to replace it".
"""

from __future__ import annotations

import re


def word_fields(text: str, fields, name: callable) -> str:
    """`text` with each field name replaced by `name(field)`: where the text marks it as code
    (`` `overwrite` ``: a message holding paths, values or the word in plain English), only
    those; else every whole-word occurrence, except inside a path (`out/x`, `out.parquet`) or a
    quoted value (`'out'`)."""
    for field in sorted(fields, key=len, reverse=True):
        marked = f"`{field}`"
        if marked in text:
            text = text.replace(marked, name(field))
        else:
            text = re.sub(rf"(?<![\w\-/.'\"`]){re.escape(field)}(?![\w\-/'\"`]|\.\w)", lambda _: name(field), text)
    return text


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
        return word_fields(str(self), self.fields, name)
