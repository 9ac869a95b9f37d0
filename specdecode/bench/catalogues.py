"""The translation category's source: German sentences from the system's gettext catalogues (the msgstr of each
German .mo file), each named by a digest of its text."""

from __future__ import annotations

import gettext
import hashlib
from pathlib import Path

from specdecode.errors import UserError

GERMAN_CATALOGUES = Path("/usr/share/locale/de/LC_MESSAGES")
TRANSLATION_SOURCE = "German message catalogues of the system's packages (/usr/share/locale/de/LC_MESSAGES/*.mo)"


def digest(text: str) -> str:
    """A short name of a text, the same on every machine (task ids and groups that follow content, not order)."""
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def german_sentences(folder: Path = GERMAN_CATALOGUES) -> list[tuple[str, str]]:
    """(id, sentence) of each German sentence in `folder`'s catalogues, in the order of their ids. An id is the
    sentence's digest: a count over the catalogues installed moved sentences between the benchmark's tuning and
    held-out parts from one machine to another."""
    sentences: dict[str, str] = {}
    for mo in sorted(folder.glob("*.mo")):
        try:
            with mo.open("rb") as handle:
                # the parsed msgid -> msgstr table (gettext keeps it private: no public way to list it)
                catalogue = vars(gettext.GNUTranslations(handle))["_catalog"]
        except (OSError, ValueError):  # not a catalogue, or not UTF-8 (UnicodeDecodeError is a ValueError)
            continue
        for msgid, msgstr in catalogue.items():
            if isinstance(msgid, str) and isinstance(msgstr, str) and msgid and _is_sentence(msgstr):
                sentences.setdefault(f"de/{digest(msgstr)}", msgstr)
    if not sentences:
        raise UserError(f"no German sentences found in {folder}: the translation category needs the system's "
                        "German message catalogues (Debian: they come with most packages' locales)")
    return sorted(sentences.items())


def _is_sentence(text: str) -> bool:
    words = text.split()
    return (8 <= len(words) <= 60 and text[0].isupper() and text.rstrip()[-1:] in ".!?" and "%" not in text
            and "\n" not in text)
