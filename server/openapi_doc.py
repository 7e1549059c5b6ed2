"""The README's API reference, generated from the app's OpenAPI schema (`lethe openapi --markdown`)."""

from __future__ import annotations

import json


def schema() -> dict:
    from lethe.server.app import create_app

    return create_app().openapi()  # the schema needs no model: the lifespan does not run


def _body(op: dict, spec: dict) -> str:
    content = op.get("requestBody", {}).get("content", {})
    ref = next((c.get("schema", {}).get("$ref") for c in content.values() if "schema" in c), None)
    if not ref:
        return ""
    props = spec["components"]["schemas"][ref.rsplit("/", 1)[1]].get("properties", {})
    return ", ".join(f"`{p}`" for p in props)


def markdown() -> str:
    spec = schema()
    lines = ["| method and path | what it does | body fields |", "| --- | --- | --- |"]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            text = (op.get("description") or op.get("summary") or "").strip().splitlines()[0]
            lines.append(f"| `{method.upper()} {path}` | {text} | {_body(op, spec)} |")
    return "\n".join(lines) + "\n"


def main(as_markdown: bool) -> str:
    return markdown() if as_markdown else json.dumps(schema(), indent=2)
