"""`lethe bench continual`: forget requests arriving one after another (issue 26), through a running server.

The facts are `lethe bench attacks`'s (`AttackBench`): on a chat model the capitals the base model knows, on the
demo its forget authors (the fifth group is the retain set's first author, moved to the forget side). The
forget subjects are dealt into `requests` disjoint groups. Request k is applied as a tenant would apply it: the
forget set becomes the union of groups 1..k, a new head (T3) or new ASU weights (ASU, distilled from the base on
that union) or both (`asu+t3`: one profile with the weights and the head, the adapter only for prompts the head's
probe calls forget-like, `adapter_above`) are trained by the server's jobs, and the one profile of that backend is
set to them (a hot swap; its earlier versions stay in its history). After each request every group's canonical
questions are asked through the served route with the profile and without it (greedy): the groups requested so far
should be forgotten, the others still answered, and retain answers identical to the base model's.

Bars (issue 26): after the last request, forget hits <= 0.05 for each group and retain identical >= 0.85.
Since no request trains on the one before, `first` runs requests first..n only (`--from-request`): the last one
alone costs one job where the whole run costs n.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from lethe.heads.evaluation.facts import hit
from lethe.server.bench import shown_path
from lethe.server.bench.attacks import CONTEXTS, AttackBench, AttackConfig, _share, spread

@dataclass
class ContinualConfig:
    requests: int = 5
    # the first request run: request k trains from the base on the union of groups 1..k, never on request k-1's
    # head or weights, so a run from request K (the last, where the bars are read) measures what a whole run would
    first: int = 1
    backends: tuple[str, ...] = ("t3",)
    limit: int | None = None  # retain questions asked, at most (None: all)
    asu: dict = field(default_factory=dict)  # the ASU job's settings (tau, layers, steps, retain_loss, ...)
    settings: dict = field(default_factory=dict)  # profile settings over the head's or the weights' defaults
    adapter_above: float = 0.5  # backend asu+t3: the probe's P(forget | prompt) above which the adapter decodes
    workers: int = 16


def deal(subjects: list[str], n: int) -> list[list[str]]:
    """`subjects` dealt round-robin into `n` disjoint groups (each non-empty), in their order."""
    if len(subjects) < n:
        raise ValueError(f"requests: {n} groups need at least {n} subjects the base model knows; it knows "
                         f"{len(subjects)}")
    return [subjects[i::n] for i in range(n)]


class ContinualBench(AttackBench):
    def __init__(self, url: str, admin_key: str, lm, cfg: ContinualConfig, log=print):
        super().__init__(url, admin_key, lm, AttackConfig(quick=True, settings=cfg.settings, workers=cfg.workers,
                                                          asu=cfg.asu, adapter_above=cfg.adapter_above), log)
        self.continual = cfg

    def _group_rows(self, profile: str, groups: list[list[str]], k: int, retain: list[dict]) -> dict:
        """Forget hits of each group and retain identity, base against `profile`, after request `k`."""
        plain, greedy = CONTEXTS[0], [{"temperature": 0.0}]
        out: dict = {"forget": []}
        for g, subjects in enumerate(groups, 1):
            pairs = self.pairs(plain, [r for r in self.facts.forget_pool if r["subject"] in subjects], greedy, profile)
            out["forget"].append({"group": g, "requested": g <= k, "n": len(pairs),
                                  "hits_base": _share([hit(b[0], r["gold"]) for r, b, _ in pairs]),
                                  "hits_profile": _share([hit(p[0], r["gold"]) for r, _, p in pairs]),
                                  # a requested group's answers that still give the fact, beside the base model's
                                  "misses": [{"question": r["question"], "gold": r["gold"], "profile": p[0],
                                              "base": b[0]} for r, b, p in pairs
                                             if g <= k and hit(p[0], r["gold"])]})
        pairs = self.pairs(plain, retain, greedy, profile)
        out["retain"] = {"n": len(pairs), "identical": _share([b[0] == p[0] for _, b, p in pairs]),
                         "hits_base": _share([hit(b[0], r["gold"]) for r, b, _ in pairs]),
                         "hits_profile": _share([hit(p[0], r["gold"]) for r, _, p in pairs])}
        return out

    def run(self) -> dict:
        started = time.perf_counter()
        n = self.continual.requests
        self.facts = self.facts_for_chat() if self.chat else self.facts_for_demo(moved=max(0, n - 4))
        all_facts = self.facts
        groups = deal(list(dict.fromkeys(r["subject"] for r in all_facts.forget_pool)), n)
        retain = spread(all_facts.retain_pool, self.continual.limit)
        rows = []
        for backend in self.continual.backends:
            profile = f"continual-{backend.replace('+', '-')}"
            for k in range(self.continual.first, n + 1):
                asked = {s for group in groups[:k] for s in group}
                self.facts = replace(all_facts, forget_train=[r for r in all_facts.forget_train
                                                              if r["subject"] in asked])
                made = self.made(backend, profile)
                row = {"backend": backend, "request": k, "forget_train": len(self.facts.forget_train),
                       "train_seconds": made["train_seconds"], "made": made["id"],
                       "profile_version": made["profile"].get("version")}
                row |= self._group_rows(profile, groups, k, retain)
                rows.append(row)
                self.log(f"{backend} after request {k}: forget hits by group "
                         + " ".join(f"{f['group']}{'*' if f['requested'] else ''}:{f['hits_profile']}"
                                    for f in row["forget"])
                         + f"; retain identical {row['retain']['identical']}")
        report = {"model": shown_path(self.lm.path), "fingerprint": self.lm.fingerprint,
                  "route": "/v1/chat/completions" if self.chat else "/v1/completions",
                  "config": asdict(self.continual), "groups": groups, "known": all_facts.known,
                  "retain_asked": len(retain), "retain_train": len(all_facts.retain_train), "rows": rows}
        report["bars"] = bars(report)
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report


def bars(report: dict) -> list[dict]:
    """Issue 26's bars on each backend's last request."""
    out = []
    for backend in report["config"]["backends"]:
        last = [r for r in report["rows"] if r["backend"] == backend][-1]
        worst = max(last["forget"], key=lambda f: f["hits_profile"] or 0)
        out.append({"backend": backend, "bar": "after the last request: forget hits <= 0.05 for each group",
                    "pass": all((f["hits_profile"] or 0) <= 0.05 for f in last["forget"]),
                    "value": worst["hits_profile"], "where": f"group {worst['group']}"})
        identical = last["retain"]["identical"]
        out.append({"backend": backend, "bar": "after the last request: retain identical >= 0.85",
                    "pass": identical is not None and identical >= 0.85, "value": identical, "where": "retain"})
    return out


def markdown(report: dict) -> str:
    """One table per backend: a line per request, forget hits of each group (requested ones starred)."""
    n = report["config"]["requests"]
    lines = [f"`{report['model']}` ({report['route']}, greedy): {n} groups of forget subjects "
             f"({', '.join(str(len(g)) for g in report['groups'])} subjects); {report['retain_asked']} retain "
             f"questions; base hits per group: "
             + ", ".join(f"{f['hits_base']}" for f in report["rows"][0]["forget"]) + "."]
    for backend in report["config"]["backends"]:
        lines += ["", f"{backend}:", "",
                  "| after request | " + " | ".join(f"group {g}" for g in range(1, n + 1))
                  + " | retain identical | retain hits base -> profile | train s |",
                  "| --- |" + " --- |" * (n + 3)]
        for r in (r for r in report["rows"] if r["backend"] == backend):
            cells = [f"**{f['hits_profile']}**" if f["requested"] else f"{f['hits_profile']}" for f in r["forget"]]
            t = r["retain"]
            lines.append(f"| {r['request']} | " + " | ".join(cells)
                         + f" | {t['identical']} | {t['hits_base']} -> {t['hits_profile']} | {r['train_seconds']} |")
    lines += ["", "Forget hits with the profile; bold: groups requested so far.", "",
              "| backend | bar | pass | value | where |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {b['backend']} | {b['bar']} | {'yes' if b['pass'] else 'no'} | {b['value']} | {b['where']} |"
              for b in report["bars"]]
    return "\n".join(lines) + "\n"


def run(url: str, admin_key: str, lm, cfg: ContinualConfig | None = None, log=print) -> dict:
    bench = ContinualBench(url, admin_key, lm, cfg or ContinualConfig(), log)
    try:
        return bench.run()
    finally:
        bench.close()
