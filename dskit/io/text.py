"""Characters that break line-oriented formats, in one place: the spec refuses them, error messages and
rendered comments escape them.

"Unsafe" means anything a reader may take as a line end or that YAML and terminals cannot carry
verbatim: C0/C1 control characters and DEL (Cc; NEL U+0085 is one), U+2028/U+2029 (Zl, Zp: YAML 1.1
readers such as PyYAML break lines there), format characters (Cf: BOM, bidi overrides that make text
display differently from what runs), surrogates (Cs: undecodable bytes of a file name) and unassigned
code points (Cn, U+FFFE/U+FFFF included).
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from collections.abc import Iterable

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


def command(words: Iterable[object]) -> str:
    """A command for the user to paste, on one line: each word one shell word, whatever it holds.

    shlex.quote where that keeps the line one line (a word of any other character, `$(...)`, quotes
    and spaces included, is single-quoted and taken literally). A word with an unsafe character (a
    newline or ESC in a file name) is written in ANSI-C quoting, $'...' (bash, zsh, ksh): one line that
    still names the same bytes, where a quoted newline would print a second line a reader could take
    for another message."""
    return " ".join(_word(str(w)) for w in words)


def _word(word: str) -> str:
    if first_unsafe(word) is None:
        return shlex.quote(word)
    out = []
    for ch in word:
        if ch in ("\\", "'"):
            out.append("\\" + ch)
        elif is_unsafe(ch):  # as its UTF-8 bytes: bash's \xHH is that byte in any locale
            out.extend(f"\\x{b:02x}" for b in _bytes(ch))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def _bytes(ch: str) -> bytes:
    try:  # an undecodable byte of a file name (surrogateescape, U+DC80..U+DCFF): that byte
        return ch.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # any other lone surrogate
        return ch.encode("utf-8", "surrogatepass")


def ascii_int(text: str) -> int | None:
    """A whole number written in ASCII digits only, at most 18 of them (int() would also take '١', '+1',
    ' 2' or '1_0'); None for anything else. The rule of the CLI's integer flags and dskit's integer
    environment variables."""
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text) else None
