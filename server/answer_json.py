"""Large JSON answers encoded a slice at a time, so the event loop keeps running while one is built.

`json.dumps` encodes in C and holds the GIL for the whole call: on a 5 MB answer (16 echoed prompts with 20
alternatives a token) that stalled /healthz for over 100 ms although it ran on a worker thread. `dumps` gives the
same bytes (`ensure_ascii=False, allow_nan=False, separators=(",", ":")`) from many short calls: containers of
containers are walked, lists of them encoded `SLICE` elements a call, and long flat lists `FLAT_SLICE` a call
(200,000 token ids in one call held it for 60 ms).
"""

from __future__ import annotations

import json

SLICE = 64
FLAT_SLICE = 4096  # a flat list (of numbers, say: /tokenize's 200,000 ids for 1 MB) is encoded this many at a time
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
    elif isinstance(value, list) and ((nested := _nested(value)) or len(value) > FLAT_SLICE):
        out.append("[")
        step = SLICE if nested else FLAT_SLICE
        for start in range(0, len(value), step):
            piece = value[start:start + step]
            if start:
                out.append(",")
            if nested and any(_nested(v) for v in piece):
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
