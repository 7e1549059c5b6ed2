"""Unlearning profiles: from a stored or inline spec to what one decoding row needs.

A profile version's spec is stored complete (backend, head id, and every tilt setting), so a
version always means the same thing. A request resolves its profile once, at admission, into
(head, settings) objects it keeps: a later swap changes what new requests get, never a request
already admitted.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lethe.heads.t3.guide import PRESETS, TiltSettings
from lethe.heads.t3.head import BaseMismatch, HeadFileError, T3Head, load_head
from lethe.heads.modelio import LoadedModel
from lethe.server.storage import Store, StoredFileError

log = logging.getLogger("lethe.profiles")


class ProfileError(Exception):
    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


def load_stored(store: Store, table: str, item_id: str, param: str, kind: str, load: Callable[[Path], Any]):
    """`load(path)` on a stored head or ASU weights file: 404 when its row went just now (deleted by a request
    racing this one), 409 when it was made for another base model, StoredFileError when the stored copy is at
    fault (missing, or failing the checks it passed when it was stored). Messages name the file, never its path."""
    try:
        path = store.file(table, item_id)
    except FileNotFoundError:
        raise ProfileError(404, param, f"{kind} {item_id!r} not found") from None

    def public(e: Exception) -> str:
        return store.public(str(e).replace(str(path), "the file"))

    try:
        return load(path)
    except BaseMismatch as e:
        raise ProfileError(409, param, public(e)) from None
    except HeadFileError as e:
        raise StoredFileError(f"the stored file of {kind} {item_id} cannot be used: {public(e)}") from None


def asu_repeat_guard(spec: dict) -> int:
    """The rows' own repeat guard of a completed spec: ASU weights alone have one (set by `complete_spec`; a spec
    stored before the field existed: none); every other row is guarded by its head's settings, or not at all."""
    return spec.get("repeat_guard", 0) if spec.get("backend") == "asu" and not spec.get("head") else 0


@dataclass(frozen=True)
class Resolved:
    name: str | None  # None for an inline profile or the base model
    version: int | None
    row: tuple[T3Head, TiltSettings] | None  # None: no T3 head
    adapter: str | None = None  # an attached ASU adapter's name; None: the base weights
    repeat_guard: int = 0  # ASU weights alone (no head): the rows' own repeat guard (0: off)
    # gives back what the request holds (its adapter pin, its row in flight); called once (generation._once)
    release: Callable[[], None] | None = field(default=None, compare=False)
    tenant: str | None = field(default=None, compare=False)  # whose request (None: anonymous): fair admission

    def done(self) -> None:
        """The request ended (finished, failed or never admitted): its adapter may be detached from now on."""
        if self.release is not None:
            self.release()


BASE = Resolved("base", None, None)


class AdapterCache:
    """ASU adapters attached to the served model (in the engine thread, between steps), so every
    adapter shares the base tensors.

    Each request pins the adapter it was admitted with until it ends: the least recently used adapter
    beyond `size` is detached only once nothing pins it, and deleting weights detaches them only after the
    last request using them has finished. Files are checked completely (`heads.asu.weights.check_asu`) against the
    projection shapes read from the base model at start, before anything is attached; `attach` is all or
    nothing, so a refused or failed attach leaves the model exactly as it was."""

    def __init__(self, store: Store, engine, size: int):
        from lethe.heads.asu.weights import projection_shapes

        self.store, self.engine, self.size = store, engine, size
        self.shapes = projection_shapes(engine.lm.model)
        self.n_layers = engine.lm.model.config.num_hidden_layers
        self._names: OrderedDict[str, str] = OrderedDict()  # weights id -> adapter name
        self._pins: dict[str, int] = {}  # weights id -> requests using it
        self._doomed: set[str] = set()  # deleted while pinned: detach when the last pin goes
        self._lock = threading.Lock()
        self._attaching = threading.Lock()

    def load(self, weights_id: str):
        """(tensors, info) of stored weights, checked against this model and this server's engine; ProfileError
        otherwise."""
        from lethe.heads.asu.weights import load_asu

        def check(path):
            tensors, info = load_asu(path, self.engine.lm.fingerprint, self.shapes, self.n_layers)
            if self.engine.decoder is not None:  # llama.cpp: a LoRA file it can read, or a 422 now
                from lethe.heads.asu.gguf import check_servable

                try:
                    check_servable(info, self.engine.lm.model.config)
                except HeadFileError as e:  # the weights are sound; this engine cannot serve them
                    raise ProfileError(422, "weights", f"this server decodes with llama.cpp (engine llamacpp): {e}")
            return tensors, info

        return load_stored(self.store, "asu_weights", weights_id, "weights", "ASU weights", check)

    def check(self, tenant_id: str, weights_id: str) -> None:
        """404 unless the tenant has these weights (for a spec that is stored, not used yet)."""
        if self.store.get("asu_weights", tenant_id, weights_id) is None:
            raise ProfileError(404, "weights", f"ASU weights {weights_id!r} not found")

    def acquire(self, tenant_id: str, weights_id: str) -> tuple[str, Callable[[], None]]:
        """The adapter's name, attached and pinned, and the function that unpins it (call it once).

        `_attaching` serialises attaches (and is held while the engine thread attaches); `_lock` guards the
        tables and is only ever held briefly, so `release`, which may run in the engine thread, never waits."""
        from lethe.heads.asu.gguf import add_to_llama_cpp
        from lethe.heads.asu.weights import attach

        self.check(tenant_id, weights_id)
        with self._attaching:
            if weights_id not in self._names:
                # read before anything is evicted: weights that fail to load (deleted meanwhile, not servable)
                # leave the table as it was, and no adapter attached but no longer listed
                tensors, info = self.load(weights_id)
                with self._lock:
                    evict = [(i, n) for i, n in self._names.items() if not self._pins.get(i)]
                    evict = evict[: max(0, len(self._names) + 1 - self.size)]
                    for old_id, _ in evict:
                        del self._names[old_id]
                name = f"asu_{weights_id}"

                def add():
                    for _, old_name in evict:
                        self._detach_now(old_name)
                    if self.engine.decoder is not None:
                        add_to_llama_cpp(self.engine.decoder, name, tensors, info, self.engine.lm.model.config)
                    else:
                        self.engine.replace_model(attach(self.engine.lm.model, name, tensors, info))

                try:
                    self.engine.control(add).result(timeout=600)
                except HeadFileError as e:
                    raise ProfileError(422, "weights", str(e)) from None
                except Exception as e:  # attach undid itself: the model is as it was; this request alone fails
                    log.exception("attaching ASU weights %s failed", weights_id)
                    raise ProfileError(500, "weights", f"attaching the ASU weights failed ({type(e).__name__}); "
                                                       f"the model is unchanged") from None
                with self._lock:
                    self._names[weights_id] = name
            with self._lock:
                self._names.move_to_end(weights_id)
                self._pins[weights_id] = self._pins.get(weights_id, 0) + 1
                name = self._names[weights_id]

        def release() -> None:
            with self._lock:
                self._pins[weights_id] -= 1
                if self._pins[weights_id] == 0:
                    del self._pins[weights_id]
                    if weights_id in self._doomed:
                        self._doomed.discard(weights_id)
                        self._names.pop(weights_id, None)
                        self.engine.control(lambda: self._detach_now(name))  # may run in the engine thread: no wait

        return name, release

    def _detach_now(self, name: str) -> None:
        from lethe.heads.asu.weights import detach

        if self.engine.decoder is not None:
            self.engine.decoder.remove_adapter(name)
        else:
            detach(self.engine.lm.model, name)

    def drop(self, weights_id: str) -> None:
        """Weights were deleted: detach them now, or when the last request using them ends."""
        with self._lock:
            if self._pins.get(weights_id):
                self._doomed.add(weights_id)
                return
            name = self._names.pop(weights_id, None)
        if name is not None:
            self.engine.control(lambda: self._detach_now(name))


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
        head, info = load_stored(self.store, "heads", head_id, "head", "head",
                                 lambda path: load_head(path, self.lm.fingerprint, cfg.vocab_size, cfg.hidden_size))
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
        adapters.check(tenant_id, spec["weights"])
        _, info = adapters.load(spec["weights"])  # a stored spec must be usable: the weights are checked now
        if not spec.get("head"):
            if spec.get("adapter_above"):
                raise ProfileError(422, "adapter_above", "adapter_above needs a head: its probe decides")
            from lethe.heads.asu.weights import default_repeat_guard

            guard = spec.get("repeat_guard", default_repeat_guard(info))
            try:
                TiltSettings(repeat_guard=guard).replace()
            except ValueError as e:
                raise ProfileError(422, "repeat_guard", str(e)) from None
            return {"backend": "asu", "weights": spec["weights"], "repeat_guard": guard}
        return {**complete_spec(cache, tenant_id, {**spec, "backend": "t3"}), "backend": "asu",
                "weights": spec["weights"]}
    if backend != "t3":
        raise ProfileError(422, "backend", f"backend {backend!r} is not one of base, t3, asu")
    if not spec.get("head"):
        raise ProfileError(422, "head", "a t3 profile needs a head id")
    if spec.get("adapter_above") and not spec.get("weights"):
        raise ProfileError(422, "adapter_above", "adapter_above applies to asu profiles (with weights) only")
    _, recommended = cache.get(tenant_id, spec["head"])
    preset = spec.get("preset")
    base = PRESETS[preset] if preset else TiltSettings.from_dict(recommended)
    given = {k: spec[k] for k in TiltSettings.names() if k in spec}
    try:
        settings = TiltSettings(**{**base.as_dict(), **given}).replace()
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise ProfileError(422, field if field in given else "profile", str(e)) from None
    return {"backend": "t3", "head": spec["head"], **settings.as_dict()}


@dataclass(frozen=True)
class Pinned:
    """A stored profile's version, read once for a request of several choices: each decodes with this one, though
    the profile changes while they are admitted (`pin`)."""

    name: str
    version: int
    spec: dict


def pin(store: Store, tenant_id: str | None, profile: str | dict | None) -> "str | dict | Pinned | None":
    """`profile` with a stored profile's name replaced by its current version (as it is otherwise: a 404 then
    comes from `resolve`, as for one choice)."""
    if tenant_id is None or not isinstance(profile, str) or profile == "base":
        return profile
    current = store.current_profile(tenant_id, profile)
    return profile if current is None else Pinned(profile, *current)


def resolve(store: Store, cache: HeadCache, tenant_id: str | None, profile: str | dict | Pinned | None,
            adapters: AdapterCache | None = None) -> Resolved:
    """What a request decodes with. `profile`: None or "base", a stored profile's name (or a version of it:
    `Pinned`), or an inline spec."""
    if profile is None or profile == "base":
        return BASE
    if tenant_id is None:
        raise ProfileError(401, "profile", "profiles need an API key")
    if isinstance(profile, dict):
        spec, name, version = complete_spec(cache, tenant_id, profile, adapters), None, None
    elif isinstance(profile, Pinned):
        spec, name, version = profile.spec, profile.name, profile.version
    else:
        current = store.current_profile(tenant_id, profile)
        if current is None:
            raise ProfileError(404, "profile", f"profile {profile!r} not found")
        (version, spec), name = current, profile
    if spec["backend"] == "base":
        return Resolved(name, version, None)
    head = None
    if spec.get("head"):  # before the adapter: a missing head must not leave an adapter pinned
        head, _ = cache.get(tenant_id, spec["head"])
    row = (head, TiltSettings.from_dict({k: spec[k] for k in TiltSettings.names() if k in spec})) \
        if head is not None else None
    if spec["backend"] != "asu":
        return Resolved(name, version, row)
    if adapters is None:
        raise ProfileError(422, "backend", "ASU is not available on this server")
    adapter, release = adapters.acquire(tenant_id, spec["weights"])
    return Resolved(name, version, row, adapter, asu_repeat_guard(spec), release)
