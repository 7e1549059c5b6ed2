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
    row: tuple[T3Head, TiltSettings] | None  # None: no T3 head
    adapter: str | None = None  # an attached ASU adapter's name; None: the base weights


BASE = Resolved("base", None, None)


class AdapterCache:
    """ASU adapters attached to the served model (in the engine thread, between steps), so every
    adapter shares the base tensors. Beyond `size`, the least recently used adapter that no running
    row uses is detached."""

    def __init__(self, store: Store, engine, size: int):
        self.store, self.engine, self.size = store, engine, size
        self._names: OrderedDict[str, str] = OrderedDict()  # weights id -> adapter name
        self._lock = threading.Lock()

    def get(self, tenant_id: str, weights_id: str) -> str:
        from heads.asu import attach, detach, load_asu

        if self.store.get("asu_weights", tenant_id, weights_id) is None:
            raise ProfileError(404, "weights", f"ASU weights {weights_id!r} not found")
        with self._lock:
            if weights_id in self._names:
                self._names.move_to_end(weights_id)
                return self._names[weights_id]
            try:
                tensors, info = load_asu(self.store.asu_path(weights_id), self.engine.lm.fingerprint)
            except BaseMismatch as e:
                raise ProfileError(409, "weights", str(e)) from None
            except HeadFileError as e:
                raise ProfileError(422, "weights", str(e)) from None
            name = f"asu_{weights_id}"

            def add():
                busy = self.engine.running_adapters
                for old_id, old_name in list(self._names.items()):
                    if len(self._names) < self.size:
                        break
                    if old_name not in busy:
                        detach(self.engine.lm.model, old_name)
                        del self._names[old_id]
                with self.engine.model_lock:
                    self.engine.replace_model(attach(self.engine.lm.model, name, tensors, info))

            self.engine.control(add).result(timeout=600)
            self._names[weights_id] = name
            return name

    def drop(self, weights_id: str) -> None:
        from heads.asu import detach

        with self._lock:
            name = self._names.pop(weights_id, None)
        if name is not None:
            def remove():
                with self.engine.model_lock:
                    detach(self.engine.lm.model, name)

            self.engine.control(remove).result(timeout=600)


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


def complete_spec(cache: HeadCache, tenant_id: str, spec: dict, adapters: "AdapterCache | None" = None) -> dict:
    """A full spec: defaults from the preset, else the head's recommendation, then the given fields.

    Backends: `base`; `t3` (a head); `asu` (ASU weights, optionally with a head as well)."""
    backend = spec.get("backend", "t3")
    if backend == "base":
        return {"backend": "base"}
    if backend == "asu":
        if not spec.get("weights"):
            raise ProfileError(422, "weights", "an asu profile needs a weights id")
        if adapters is None:
            raise ProfileError(422, "backend", "ASU is not available on this server")
        adapters.get(tenant_id, spec["weights"])
        if not spec.get("head"):
            return {"backend": "asu", "weights": spec["weights"]}
        return {**complete_spec(cache, tenant_id, {**spec, "backend": "t3"}), "backend": "asu",
                "weights": spec["weights"]}
    if backend != "t3":
        raise ProfileError(422, "backend", f"backend {backend!r} is not one of base, t3, asu")
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


def resolve(store: Store, cache: HeadCache, tenant_id: str | None, profile: str | dict | None,
            adapters: AdapterCache | None = None) -> Resolved:
    """What a request decodes with. `profile`: None or "base", a stored profile's name, or an inline spec."""
    if profile is None or profile == "base":
        return BASE
    if tenant_id is None:
        raise ProfileError(401, "profile", "profiles need an API key")
    if isinstance(profile, dict):
        spec, name, version = complete_spec(cache, tenant_id, profile, adapters), None, None
    else:
        current = store.current_profile(tenant_id, profile)
        if current is None:
            raise ProfileError(404, "profile", f"profile {profile!r} not found")
        (version, spec), name = current, profile
    if spec["backend"] == "base":
        return Resolved(name, version, None)
    adapter = None
    if spec["backend"] == "asu":
        if adapters is None:
            raise ProfileError(422, "backend", "ASU is not available on this server")
        adapter = adapters.get(tenant_id, spec["weights"])
    if not spec.get("head"):
        return Resolved(name, version, None, adapter)
    head, _ = cache.get(tenant_id, spec["head"])
    settings = TiltSettings.from_dict({k: spec[k] for k in ("T", "lam", "gate", "candidates", "cap")})
    return Resolved(name, version, (head, settings), adapter)
