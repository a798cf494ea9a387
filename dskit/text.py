"""Characters that break line-oriented formats, in one place: the spec refuses them, error messages and
rendered comments escape them.

"Unsafe" means anything a reader may take as a line end or that YAML and terminals cannot carry
verbatim: C0/C1 control characters and DEL (Cc; NEL U+0085 is one), U+2028/U+2029 (Zl, Zp: YAML 1.1
readers such as PyYAML break lines there), format characters (Cf: BOM, bidi overrides that make text
display differently from what runs), surrogates (Cs: undecodable bytes of a file name) and unassigned
code points (Cn, U+FFFE/U+FFFF included).
"""

from __future__ import annotations

import unicodedata

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def is_unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def first_unsafe(text: str) -> str | None:
    """The first unsafe character of `text`, or None."""
    return next((ch for ch in text if is_unsafe(ch)), None)


def escape(text: str) -> str:
    """`text` on one line: unsafe characters as \\n, \\xNN, \\uNNNN (like repr), the rest unchanged."""
    if first_unsafe(text) is None:
        return text
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif is_unsafe(ch):
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
        else:
            out.append(ch)
    return "".join(out)


_CATEGORY_NAMES = {
    "Cc": "a control character",
    "Cf": "a format character",
    "Cs": "a surrogate",
    "Cn": "an unassigned code point",
}


def describe(ch: str) -> str:
    """'U+2028 (LINE SEPARATOR)' or 'U+0085 (a control character)' for an error message."""
    cat = unicodedata.category(ch)
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, _CATEGORY_NAMES.get(cat, cat))})"


def comment(text: str, prefix: str = "# ") -> str:
    """One comment line for a shell script or YAML file, whatever `text` holds: a value pasted into a
    comment cannot end it and start a line of code or a YAML key."""
    return prefix + escape(text)
