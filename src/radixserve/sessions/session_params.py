"""Which session a generate request continues, and how: the ``session_params`` of SGLang's
request. It travels inside ``TokenizedGenerateReqInput`` (``managers/io_struct.py``), and the
session tree (``session.py``) reads it; it lives here, below both, so that sessions/ never imports
the processes' messages."""

from __future__ import annotations

import msgspec


class SessionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's five fields; any other is a 400 naming it (it would have no effect)."""

    id: str
    rid: str | None = None  # the request this one continues (None: a new root of the tree)
    offset: int | None = None  # keep only this many of the inherited tokens
    replace: bool = False  # remove that request's descendants (with rid None: every request)
    drop_previous_output: bool = False  # inherit its prompt without its output
