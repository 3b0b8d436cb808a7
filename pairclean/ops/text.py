"""Text from the data, shown to a person: the characters that would hide or rearrange what is
shown are made visible.

Captions, keys and paths come from whoever made the dataset. A NUL, an escape sequence or a
carriage return can rewrite a terminal line; a right-to-left override shows `rtl\\u202egpj.exe` as
`rtlexe.jpg`; a lone surrogate cannot even be written as UTF-8. Every page (`curate.pages`) and
the command line's console (`cli.terminal`) pass data text through `visible`, so each of these
shows as `<U+202E>`, the code point in plain ASCII, wherever pairclean shows it.
"""

from __future__ import annotations

import re

# Control characters (C0 and C1, DEL) but tab and newline, lone surrogates, the line and paragraph
# separators, and the format characters that reorder text (bidirectional embeddings, overrides,
# isolates and marks).
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029"
                     "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def code_point(char: str) -> str:
    """How a hidden character is shown: `<U+202E>`."""
    return f"<U+{ord(char):04X}>"


def visible(text: str) -> str:
    """`text` with every control character (C0 and C1 but tab and newline), bidirectional format
    character, line or paragraph separator and lone surrogate shown by its code point (`code_point`)."""
    return _HIDDEN.sub(lambda m: code_point(m.group()), text)
