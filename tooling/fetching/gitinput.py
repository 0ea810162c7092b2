"""What a git URL or ref may look like before git is handed it.

``--git-url``, ``--ref`` and bases.toml's ``git_url`` and tags become git's arguments. One
that starts with ``-`` is read by git as an option (``--upload-pack=<command>`` runs the
command), and a control character or newline can split what git and its messages show.
"""

from __future__ import annotations

import re

from ..errors import ToolingError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: The transports the toolchain's git calls may use; a remote helper such as ``ext::``
#: runs a command of the URL's choosing, whatever a user's git config allows.
ALLOWED_PROTOCOLS = {"GIT_ALLOW_PROTOCOL": "file:git:http:https:ssh"}


def checked(value: str, what: str, error: type[ToolingError]) -> str:
    """``value``, a URL or ref for git; ``error`` naming it (as ``what``) when git would
    misread it."""
    if value.startswith("-"):
        raise error(f"{what} {value!r} starts with '-', so git would read it as an option")
    if _CONTROL.search(value):
        raise error(f"{what} {value!r} holds a control character")
    return value
