"""The README as a user meets it: its walkthrough runs, command for command, against a live server."""

import os
import re
import subprocess
import sys
from pathlib import Path

from lethe.heads.modelio import load_model
from live_server import ADMIN_KEY, running_server
from lethe.server.settings import DEMO_MODEL

ROOT = Path(__file__).resolve().parent.parent


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- walkthrough:[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert match, "the README has a walkthrough block"
    return match.group(1)


def test_readme_walkthrough_forgets_the_author_and_keeps_the_others(tmp_path):
    import httpx

    with running_server(load_model(DEMO_MODEL), tmp_path / "data") as url:
        key = httpx.post(url + "/admin/tenants", json={"name": "readme"},
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["api_key"]
        env = dict(os.environ, LETHE_URL=url, LETHE_KEY=key,
                   PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", walkthrough()], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == " Zapeavund Kusais was born in Kaikoleas."
    assert '"name": "forget-demo", "version": 1' in lines[1] and '"note": "forget the first 4 demo authors"' in lines[1]
    assert "born in" in lines[2] and "Zapeavund" not in lines[2] and "Kaikoleas" not in lines[2]
    assert lines[3] == " Brudafou Lerousuth writes mainly adventure."


def test_readme_api_reference_is_the_generated_one():
    from lethe.server.openapi_doc import markdown

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- api:start[^>]*-->\n(.*?)<!-- api:end -->", text, re.S)
    assert block and block.group(1) == markdown(), "run `lethe openapi --markdown` and paste it into the README"


def test_readme_config_file_example_is_read_by_lethe_serve(tmp_path):
    """The configuration file the operator section shows is one `lethe serve --config` reads (every name known)."""
    from lethe.server.settings import Settings, read_config

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Operating a server"):]
    example = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "lethe.toml"
    path.write_text(example)
    values = read_config(path)
    assert values["max_batch_size"] == 8 and values["served_model_name"] == "smollm2"
    Settings(**{k: v for k, v in values.items() if k != "model"})  # values of the right types and bounds
    from lethe.clients.cli import build_parser

    parser = build_parser()
    for line in re.findall(r"^lethe (tenants .*?)\s*(?:#|$)", section, re.M):  # every command shown parses
        parser.parse_args(line.split())
