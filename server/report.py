"""The forgetting report of one profile version: what was asked to be forgotten, what forgets it, when the version
served, how it was evaluated, and a digest that lets anyone check the report later.

`gather` reads it from the store as plain JSON (the same for the same database, so a report made twice is the
same bytes); `render_html` writes it as one self-contained page, with the canonical JSON embedded
(`<script type="application/json" id="lethe-report">`) and its sha256 shown: `verify` recomputes it.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from datetime import datetime, timezone

from lethe.server.storage import Store

FORMAT = 1
# scalar metrics worth a row in the report, in this order (an evaluation job's report has these per set)
METRICS = ("rouge", "prob", "truth_ratio", "nonword_rate", "repeated_3gram_rate", "loop_rate")


class ReportError(LookupError):
    """No such profile or version."""


def canonical(value) -> str:
    """The JSON whose sha256 is a report's digest: keys sorted, no spaces, UTF-8 as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _dataset(store: Store, tenant_id: str, role: str, recorded: dict | None, dataset_id: str | None) -> dict:
    """A training input as the job recorded it when it was submitted, else as the datasets table has it now."""
    if recorded:
        return {"role": role, **recorded}
    row = store.get("datasets", tenant_id, dataset_id) if dataset_id else None
    if row is None:
        return {"role": role, "id": dataset_id, "name": None, "records": None, "sha256": None,
                "note": "deleted since, and not recorded by the job (made before release 0.2)"}
    return {"role": role, "id": row["id"], "name": row["name"], "records": row["records"], "sha256": row["sha256"]}


def _trained(store: Store, tenant_id: str, table: str, item_id: str) -> tuple[dict, list[dict]]:
    """A head's or ASU weights' description and the datasets it was trained on."""
    row = store.get(table, tenant_id, item_id)
    if row is None:
        return {"id": item_id, "note": "deleted since"}, []
    info = json.loads(row["info"] or "{}")
    out = {"id": item_id, "sha256": row["sha256"], "bytes": row["bytes"], "created": row["created"],
           "job": row["job_id"], "info": info}
    if row["job_id"] is None:
        return out | {"note": "uploaded: trained elsewhere (lethe heads train / asu train); its training data is "
                              "not known to this server"}, []
    job = store.get("jobs", tenant_id, row["job_id"]) or {}
    params = json.loads(job.get("params") or "{}")
    inputs = params.pop("inputs", {}) or {}
    out["training"] = {k: v for k, v in params.items() if k not in ("forget", "retain")}
    return out, [_dataset(store, tenant_id, role, inputs.get(role), params.get(role)) for role in ("forget", "retain")]


def _periods(trail: list[dict], version: int, created: float) -> list[dict]:
    """When `version` was the current one: [{from, until (None: still), by}] from the audit trail's profile
    entries (set, rollback, delete). A version older than the trail counts from its creation."""
    periods, current = [], None
    for entry in trail:
        after = (entry["after"] or {}).get("version") if entry["action"] != "profile.delete" else None
        if current is not None and after != version:
            current["until"] = entry["at"]
            periods.append(current)
            current = None
        if after == version and current is None:
            current = {"from": entry["at"], "until": None, "by": entry["actor"], "action": entry["action"]}
    if current is not None:
        periods.append(current)
    if not periods and (not trail or (trail[0]["before"] or {}).get("version") == version):
        periods.append({"from": created, "until": trail[0]["at"] if trail else None, "by": None,
                        "action": "made before the audit trail"})
    return periods


def _evaluations(store: Store, tenant_id: str, name: str, version: int, spec: dict) -> list[dict]:
    """Evaluation jobs that ran on this version (recorded by version; jobs from before that, by equal settings)."""
    out = []
    for job in store.list("jobs", tenant_id):
        if job["kind"] != "eval" or job["status"] != "succeeded":
            continue
        params = json.loads(job["params"] or "{}")
        if params.get("profile") != name or (params.get("version") or version) != version or params.get("spec") != spec:
            continue
        metrics = json.loads(job["metrics"] or "{}")
        out.append({"job": job["id"], "finished": job["finished"], "max_new_tokens": params.get("max_new_tokens"),
                    "seeds": params.get("seeds"), "model_utility": metrics.get("model_utility"),
                    "forget_quality": metrics.get("forget_quality"),
                    **{part: {k: metrics.get(part, {}).get(k) for k in METRICS if k in metrics.get(part, {})}
                       for part in ("forget", "retain")}})
    return out


def gather(store: Store, tenant_id: str, name: str, version: int | None, model: dict) -> dict:
    """The report of profile `name`'s `version` (None: the current one), as JSON with its `digest`."""
    history = store.profile_history(tenant_id, name)
    current = store.current_profile(tenant_id, name)
    if not history or current is None:
        raise ReportError(f"profile {name!r} not found")
    version = current[0] if version is None else version
    entry = next((h for h in history if h["version"] == version), None)
    if entry is None:
        raise ReportError(f"profile {name!r} has no version {version}")
    spec = entry["spec"]
    tenant = store.q("SELECT name FROM tenants WHERE id = ?", tenant_id)[0]["name"]
    trail = store.audit_trail(tenant_id, profile=name, limit=100_000)
    profile_trail = [e for e in trail if e["action"].startswith("profile.")]
    since = max((e["at"] for e in trail if e["action"] == "profile.delete"), default=None)
    if since is not None:  # only this incarnation of the name: versions before a delete are other settings
        profile_trail = [e for e in profile_trail if e["at"] > since or e["action"] == "profile.delete"]
    datasets, trained = [], {}
    for table, key in (("heads", "head"), ("asu_weights", "weights")):
        if spec.get(key):
            trained[key], used = _trained(store, tenant_id, table, spec[key])
            datasets += [dict(d, used_by=key) for d in used]
    version_trail = [e for e in profile_trail if (e["after"] or {}).get("version") == version
                     or (e["before"] or {}).get("version") == version]
    body = {"format": FORMAT, "tenant": tenant, "profile": name, "version": version, "spec": spec,
            "note": entry["note"], "created": entry["created"], "current": current[0] == version,
            "served": _periods(profile_trail, version, entry["created"]), "model": model, "datasets": datasets,
            **trained, "evaluations": _evaluations(store, tenant_id, name, version, spec),
            "audit": [{k: e[k] for k in ("id", "at", "actor", "action", "before", "after")} for e in version_trail]}
    return body | {"digest": hashlib.sha256(canonical(body).encode()).hexdigest()}


def _when(t: float | None) -> str:
    return "—" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(headers: list[str], rows: list[list]) -> str:
    """A table; a column whose header ends in sha256 is set in monospace and may break anywhere."""
    if not rows:
        return "<p class=none>None.</p>"
    hashes = {i for i, h in enumerate(headers) if h.endswith("sha256")}

    def cells(tag: str, r: list) -> str:
        return "".join(f"<{tag}{' class=hash' if i in hashes and tag == 'td' else ''}>"
                       f"{html.escape('—' if v is None else str(v))}</{tag}>" for i, v in enumerate(r))

    return ("<table><thead><tr>" + cells("th", headers) + "</tr></thead><tbody>"
            + "".join(f"<tr>{cells('td', r)}</tr>" for r in rows) + "</tbody></table>")


def _number(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


STYLE = """body{font:15px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1b1f24}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;width:100%;margin:.5rem 0}th,td{border:1px solid #d0d7de;padding:.3rem .5rem;
text-align:left;vertical-align:top;overflow-wrap:break-word}th{background:#f6f8fa}
code,.hash{font-family:ui-monospace,monospace;font-size:.85em}.hash{word-break:break-all}.sub{color:#57606a}.none{color:#57606a;font-style:italic}
.digest{background:#f6f8fa;border:1px solid #d0d7de;padding:.6rem;margin-top:1rem}"""


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (no scripts run, nothing fetched)."""
    r, esc = report, html.escape
    body = {k: v for k, v in r.items() if k != "digest"}
    trained, settings = [], []
    for key, label in (("head", "T3 head"), ("weights", "ASU weights")):
        if key in r:
            t = r[key]
            trained.append([label, t.get("id"), t.get("sha256"), t.get("bytes"), _when(t.get("created"))])
            settings.append(f"<p><b>{label}</b>: {esc(t['note'])}</p>" if t.get("note") else
                            f"<p><b>{label}</b>, trained by job <code>{esc(str(t.get('job')))}</code> with:</p>"
                            f"<pre><code>{esc(json.dumps(t.get('training') or {}, indent=2, sort_keys=True))}"
                            "</code></pre>")
    evals = [[e["job"], _when(e["finished"]), part, *(_number(e[part].get(k)) if k in e[part] else None
                                                       for k in METRICS)]
             for e in r["evaluations"] for part in ("forget", "retain")]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>Forgetting report: {esc(r['profile'])} v{r['version']}</title><style>{STYLE}</style></head><body>",
        f"<h1>Forgetting report: profile <code>{esc(r['profile'])}</code>, version {r['version']}</h1>",
        f"<p class=sub>Tenant <b>{esc(r['tenant'])}</b> · model <code>{esc(str(r['model'].get('name')))}</code> "
        f"(fingerprint <code>{esc(str(r['model'].get('fingerprint')))}</code>) · version made "
        f"{_when(r['created'])}{' · <b>current</b>' if r['current'] else ' · not current'}</p>",
        f"<div class=digest>Digest (sha256 of the canonical JSON embedded in this page): "
        f"<span class=hash id=digest>{r['digest']}</span></div>",
        "<h2>What was asked to be forgotten, and what was kept</h2>",
        _table(["Role", "Dataset", "Name", "Records", "sha256", "Used by"],
               [[d["role"], d.get("id"), d.get("name"), d.get("records"), d.get("sha256") or d.get("note"),
                 d.get("used_by")] for d in r["datasets"]]),
        "<h2>What forgets it</h2>",
        _table(["Kind", "Id", "sha256", "Bytes", "Made"], trained), *settings,
        "<h2>Settings of this version</h2>", f"<pre><code>{esc(json.dumps(r['spec'], indent=2, sort_keys=True))}"
                                                f"</code></pre>",
        "<h2>When it served</h2>",
        _table(["From", "Until", "By", "How"], [[_when(p["from"]), "still current" if p["until"] is None
                                                 else _when(p["until"]), p["by"], p["action"]] for p in r["served"]]),
        "<h2>Evaluations of this version</h2>",
        _table(["Job", "Finished", "Set", *METRICS], evals),
        "<h2>Audit entries for this version</h2>",
        _table(["#", "When", "Actor", "Action"], [[e["id"], _when(e["at"]), e["actor"], e["action"]]
                                                  for e in r["audit"]]),
        '<script type="application/json" id="lethe-report">',
        canonical(body).replace("</", "<\\/"), "</script></body></html>\n"]
    return "\n".join(parts)


def verify(page: str) -> tuple[bool, str]:
    """(whether the page is exactly what its embedded data makes, with the digest it shows; that digest). Any
    change to what a reader sees or to the data fails. Compare the digest with one recorded when the report was
    made (or with the server's report made again) to know the data is the server's: a digest is no signature."""
    found = re.search(r'<script type="application/json" id="lethe-report">\n(.*?)\n</script>', page, re.S)
    shown = re.search(r"<span class=hash id=digest>([0-9a-f]{64})</span>", page)
    if not found or not shown:
        return False, ""
    try:
        body = json.loads(found.group(1))  # JSON reads the `<\/` written for `</` as `</`
    except ValueError:
        return False, shown.group(1)
    digest = hashlib.sha256(canonical(body).encode()).hexdigest()
    return digest == shown.group(1) and render_html(body | {"digest": digest}) == page, shown.group(1)
