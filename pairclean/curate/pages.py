"""The one way data enters a page pairclean writes (the report, the audit page).

A page is a template filled in one pass (`render`): each `{{name}}` is replaced by its value once,
and a replaced value is never scanned again, so a caption reading `{{title}}` or `__ITEMS__` stays
a caption. What a value becomes depends on its type, never on where the author remembered to
escape:

* `Html`: markup pairclean built (itself by `render`), inserted as it is;
* `ScriptJson`: data for a script, as JSON with `<`, `>`, `&`, U+2028 and U+2029 written as
  JSON's `\\u` escapes (`<` becomes `\\u003c`), so no string in it can end the script (`</script>`) or enter the HTML
  spec's script-data-escaped states (`<!--<script>`) that keep the page's `</script>` from
  closing it;
* anything else: text, with control and bidirectional-format characters made visible
  (`ops.text.visible`) and `& < > " '` escaped, safe in element content and quoted attributes.

A template names every value it takes and takes every value it is given: a missing or an unused
value is a programming error, raised before a page is written.
"""

from __future__ import annotations

import html
import json
import re
from importlib.resources import files

from pairclean.ops.text import visible

_FIELD = re.compile(r"\{\{(\w+)\}\}")
_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


class Html(str):
    """Markup pairclean wrote: `render` inserts it as it is."""


class ScriptJson(str):
    """A value as JSON that is safe inside `<script>` (see the module docstring)."""

    def __new__(cls, value) -> ScriptJson:
        text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        return super().__new__(cls, re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_UNSAFE[m.group()], text))


def escape(value) -> Html:
    """Text for element content or a quoted attribute value."""
    return Html(html.escape(visible(str(value)), quote=True))


def _insert(value) -> str:
    if isinstance(value, (Html, ScriptJson)):
        return value
    return escape(value)


def render(template: str, **values) -> Html:
    """`template` with each `{{name}}` replaced, in one pass, by its value (see the module docstring)."""
    names = set(_FIELD.findall(template))
    if names != set(values):
        missing, unused = sorted(names - set(values)), sorted(set(values) - names)
        raise KeyError(f"template fields missing: {missing}; values not in the template: {unused}")
    return Html(_FIELD.sub(lambda m: _insert(values[m.group(1)]), template))


def join(parts) -> Html:
    """Rendered parts side by side."""
    return Html("".join(_insert(part) for part in parts))


def template(package: str, name: str) -> str:
    """A page template shipped beside a module (`page.html` in `pairclean.curate.report` ...)."""
    return (files(package) / name).read_text(encoding="utf-8")
