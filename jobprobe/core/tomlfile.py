# SPDX-License-Identifier: Apache-2.0
"""tomlfile — reading a TOML file a person handed over (the agent's config, a rules file, a price file).

Whatever is wrong with it — not there, not readable, not UTF-8, not TOML — is one BadInput line naming the file
(and the line, where the parser says): the CLI's exit 2, the agent's logged refusal. What the table holds is the
caller's to check."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from jobprobe.core.errors import BadInput


def read(path: str | Path, what: str) -> tuple[str, dict[str, Any]]:
    """The file's text and its table; `what` names the kind of file in an error ("rules", "prices")."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as err:
        raise BadInput(f"{what} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (OSError, ValueError) as err:          # (ValueError: a path with a NUL in it)
        raise BadInput(f"{what} {path}: {getattr(err, 'strerror', None) or err}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        m = re.search(r"\(at line (\d+)", str(err))
        why = str(err).split(" (at ")[0]
        raise BadInput(f"{what} {path} line {m.group(1)}: {why}" if m else f"{what} {path}: {why}") from None
