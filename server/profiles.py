"""Unlearning profiles: from a stored or inline spec to what one decoding row needs.

A profile version's spec is stored complete (backend, head id, and every tilt setting), so a
version always means the same thing. A request resolves its profile once, at admission, into
(head, settings) objects it keeps: a later swap changes what new requests get, never a request
already admitted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from heads.guide import PRESETS, TiltSettings
from heads.head import BaseMismatch, HeadFileError, T3Head, load_head
from heads.modelio import LoadedModel
from server.storage import Store


class ProfileError(Exception):
    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class Resolved:
    name: str | None  # None for an inline profile or the base model
    version: int | None
    row: tuple[T3Head, TiltSettings] | None  # None: decode from the base model alone


BASE = Resolved("base", None, None)


class HeadCache:
    """Heads in memory, least recently used dropped beyond `size`."""

    def __init__(self, store: Store, lm: LoadedModel, size: int):
        self.store, self.lm, self.size = store, lm, size
        self._heads: OrderedDict[str, tuple[T3Head, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant_id: str, head_id: str) -> tuple[T3Head, dict]:
        """The head and its recommended settings; 404 when the tenant has no such head."""
        if self.store.get("heads", tenant_id, head_id) is None:
            raise ProfileError(404, "head", f"head {head_id!r} not found")
        with self._lock:
            if head_id in self._heads:
                self._heads.move_to_end(head_id)
                return self._heads[head_id]
        cfg = self.lm.model.config
        try:
            head, info = load_head(self.store.head_path(head_id), self.lm.fingerprint, cfg.vocab_size,
                                   cfg.hidden_size)
        except BaseMismatch as e:
            raise ProfileError(409, "head", str(e)) from None
        except HeadFileError as e:
            raise ProfileError(422, "head", str(e)) from None
        head.to(self.lm.device)
        with self._lock:
            self._heads[head_id] = (head, info.profile)
            while len(self._heads) > self.size:
                self._heads.popitem(last=False)
        return head, info.profile

    def drop(self, head_id: str) -> None:
        with self._lock:
            self._heads.pop(head_id, None)


def complete_spec(cache: HeadCache, tenant_id: str, spec: dict) -> dict:
    """A full spec: defaults from the preset, else the head's recommendation, then the given fields."""
    backend = spec.get("backend", "t3")
    if backend == "base":
        return {"backend": "base"}
    if backend != "t3":
        raise ProfileError(422, "backend", f"backend {backend!r} is not available on this server")
    if not spec.get("head"):
        raise ProfileError(422, "head", "a t3 profile needs a head id")
    _, recommended = cache.get(tenant_id, spec["head"])
    preset = spec.get("preset")
    base = PRESETS[preset] if preset else TiltSettings.from_dict(recommended)
    given = {k: spec[k] for k in ("T", "lam", "gate", "candidates", "cap") if k in spec}
    try:
        settings = TiltSettings(**{**base.as_dict(), **given}).replace()
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise ProfileError(422, field if field in given else "profile", str(e)) from None
    return {"backend": "t3", "head": spec["head"], **settings.as_dict()}


def resolve(store: Store, cache: HeadCache, tenant_id: str | None, profile: str | dict | None) -> Resolved:
    """What a request decodes with. `profile`: None or "base", a stored profile's name, or an inline spec."""
    if profile is None or profile == "base":
        return BASE
    if tenant_id is None:
        raise ProfileError(401, "profile", "profiles need an API key")
    if isinstance(profile, dict):
        spec, name, version = complete_spec(cache, tenant_id, profile), None, None
    else:
        current = store.current_profile(tenant_id, profile)
        if current is None:
            raise ProfileError(404, "profile", f"profile {profile!r} not found")
        (version, spec), name = current, profile
    if spec["backend"] == "base":
        return Resolved(name, version, None)
    head, _ = cache.get(tenant_id, spec["head"])
    settings = TiltSettings.from_dict({k: spec[k] for k in ("T", "lam", "gate", "candidates", "cap")})
    return Resolved(name, version, (head, settings))
