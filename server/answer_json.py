"""Large JSON answers encoded a slice at a time, so the event loop keeps running while one is built.

`json.dumps` encodes in C and holds the GIL for the whole call: on a 5 MB answer (16 echoed prompts with 20
alternatives a token) that stalled /healthz for over 100 ms although it ran on a worker thread. `dumps` gives the
same bytes (`ensure_ascii=False, allow_nan=False, separators=(",", ":")`) from many short calls: containers of
containers are walked, and lists of them encoded `SLICE` elements a call.
"""

from __future__ import annotations

import json

SLICE = 64
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _nested(value) -> bool:
    return isinstance(value, (list, dict)) and any(isinstance(v, (list, dict))
                                                   for v in (value.values() if isinstance(value, dict) else value))


def _parts(value, out: list[str]) -> None:
    if isinstance(value, dict) and _nested(value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _encode(str(key)) + ":")
            _parts(item, out)
        out.append("}")
    elif isinstance(value, list) and _nested(value):
        out.append("[")
        for start in range(0, len(value), SLICE):
            piece = value[start:start + SLICE]
            if start:
                out.append(",")
            if any(_nested(v) for v in piece):
                for i, item in enumerate(piece):
                    if i:
                        out.append(",")
                    _parts(item, out)
            else:
                out.append(_encode(piece)[1:-1])
        out.append("]")
    else:
        out.append(_encode(value))


def dumps(value) -> bytes:
    """`json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()`, a slice at a time."""
    out: list[str] = []
    _parts(value, out)
    return "".join(out).encode()
