"""The client's types: `Lethe` answers results, `AsyncLethe` coroutines (and async iterators) of the same results.

mypy checks a small program that uses both clients as their users would, and a second one whose every line marked
`# wrong` misuses them (an un-awaited coroutine read as a result, a sync answer awaited, an async stream in a plain
`for`): mypy must pass the first and flag exactly the marked lines of the second, so the check is known to bite.
mypy cannot follow setuptools' editable import hook, so it is given the package as a folder: `lethe/` with links
to the repository's folders (a namespace package, like the installed one). The client module itself is checked
with --strict too; the modules it imports are read for their types only (`lethe.heads` not at all: torch).
"""

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from lethe.clients.client import AsyncLethe, Lethe

ROOT = Path(__file__).resolve().parent.parent

GOOD = '''
from pathlib import Path

from lethe.clients.client import AsyncLethe, Lethe, LetheConnectionError, LetheError
from lethe.server.protocol import DatasetOut, GenerateResponse, JobOut, ProfileOut


def sync_use(c: Lethe) -> str:
    status: str = c.health()["status"]
    forget: DatasetOut = c.upload_dataset(Path("forget.jsonl"))
    retain = c.upload_dataset(b"{}", name="retain")
    ids: list[str] = [d.id for d in c.list_datasets()]
    job: JobOut = c.wait(c.train_head(forget.id, retain.id, rank=8), on_progress=print, timeout=60.0)
    head = c.get_head(job.head or ids[0])
    rank: int = head.rank
    states: list[str] = [state.status for state in c.job_events(job.id)]
    profile: ProfileOut = c.set_profile("p", head=head.id)
    version: int = c.rollback_profile(profile.name, version=1).version
    answer: GenerateResponse = c.generate("Question: q\\nAnswer:", profile="p", temperature=0)
    streamed: str = "".join(c.stream_generate("Question: q\\nAnswer:", temperature=0))
    metrics = c.wait(c.evaluate(forget.id, retain.id, "p", seeds=[0])).metrics
    c.delete_head(head.id)
    names: list[str] = [t.name for t in c.list_tenants()] + [k.id for k in c.list_keys("t")]
    api_key: str = c.rotate_key("t", "key_1").api_key
    return answer.text + streamed + status + str((rank, states, version, metrics, names, api_key))


async def async_use(c: AsyncLethe) -> str:
    status: str = (await c.health())["status"]
    forget: DatasetOut = await c.upload_dataset(Path("forget.jsonl"))
    retain = await c.upload_dataset(b"{}", name="retain")
    ids: list[str] = [d.id for d in await c.list_datasets()]
    started = await c.train_head(forget.id, retain.id, rank=8)
    job: JobOut = await c.wait(started, on_progress=print, timeout=60.0)
    head = await c.get_head(job.head or ids[0])
    rank: int = head.rank
    states: list[str] = [state.status async for state in c.job_events(job.id)]
    profile: ProfileOut = await c.set_profile("p", head=head.id)
    version: int = (await c.rollback_profile(profile.name, version=1)).version
    answer: GenerateResponse = await c.generate("Question: q\\nAnswer:", profile="p", temperature=0)
    streamed: str = "".join([t async for t in c.stream_generate("Question: q\\nAnswer:", temperature=0)])
    metrics = (await c.wait(await c.evaluate(forget.id, retain.id, "p", seeds=[0]))).metrics
    await c.delete_head(head.id)
    names: list[str] = [t.name for t in await c.list_tenants()] + [k.id for k in await c.list_keys("t")]
    api_key: str = (await c.rotate_key("t", "key_1")).api_key
    cancelled: JobOut = await c.cancel_job(job.id)
    return answer.text + streamed + status + str((rank, states, version, metrics, names, api_key, cancelled))


async def main(url: str, key: str) -> str:
    try:
        with Lethe(url, key=key, timeout=5) as c:
            text = sync_use(c)
        async with AsyncLethe(url, key=key, timeout=5) as a:
            return text + await async_use(a)
    except LetheConnectionError as e:
        return e.message + e.url
    except LetheError as e:
        status: int = e.status
        return f"{status} {e.message}"
'''


WRONG = '''
from lethe.clients.client import AsyncLethe, Lethe
from lethe.server.protocol import DatasetOut, JobOut


async def misuse(a: AsyncLethe, s: Lethe) -> None:
    print(a.get_job("job_1").status)  # wrong: an un-awaited coroutine has no .status
    job: JobOut = a.train_head("ds_1", "ds_2")  # wrong: a coroutine is not a JobOut
    print(len(a.list_datasets()))  # wrong: nor is it a list
    print(await a.wait("job_1").id)  # wrong: .id of the coroutine, before the await
    for text in a.stream_generate("q"):  # wrong: an async iterator in a plain for
        print(text)
    print(await s.get_dataset("ds_1"))  # wrong: the sync client's answer is not awaitable
    async for state in s.job_events("job_1"):  # wrong: a sync iterator in an async for
        print(state)
    dataset: DatasetOut = s.get_job("job_1")  # wrong: a JobOut is not a DatasetOut
    print(job, dataset)
    async with AsyncLethe() as opened:
        print(opened.get_job("job_1").status)  # wrong: the same client through `async with`
    with Lethe() as plain:
        print(await plain.get_job("job_1"))  # wrong: and the sync one through `with`
'''


def _mypy(tmp_path: Path) -> subprocess.CompletedProcess:
    package = tmp_path / "lethe"  # no __init__.py: a namespace package, as installed
    package.mkdir()
    for folder in ("clients", "server", "heads"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    (tmp_path / "mypy.ini").write_text(textwrap.dedent("""\
        [mypy]
        follow_imports = silent
        [mypy-lethe.heads.*]
        follow_imports = skip
        """))
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "wrong.py").write_text(WRONG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")} | {"MYPYPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--strict", "--no-pretty",
                           "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                           "-m", "good", "-m", "wrong", "-m", "lethe.clients.client"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_mypy_passes_the_right_use_of_both_clients_and_flags_each_misuse(tmp_path):
    done = _mypy(tmp_path)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: mypy itself failed (a bad path, a crash)
    errors = re.findall(r"^(\S+?):(\d+): error: (.*)$", done.stdout, re.M)
    assert not [e for e in errors if e[0] != "wrong.py"], done.stdout  # the client and the right use: no error
    marked = {i for i, line in enumerate(WRONG.splitlines(), 1) if "# wrong" in line}
    flagged = {int(line) for path, line, _ in errors if path == "wrong.py"}
    assert flagged == marked, done.stdout
    assert done.returncode == 1


def test_the_async_client_has_the_sync_clients_methods_as_coroutines():
    def public(cls):
        return {name: f for name, f in vars(cls).items() if not name.startswith("_") and callable(f)}

    sync, async_ = public(Lethe), public(AsyncLethe)
    assert set(sync) - {"close"} == set(async_) - {"aclose"}
    for name, f in async_.items():
        g = sync.get(name, Lethe.close)
        assert inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f), name
        assert not inspect.iscoroutinefunction(g) and not inspect.isasyncgenfunction(g), name
        s, a = inspect.signature(g), inspect.signature(f)
        assert list(s.parameters.values()) == list(a.parameters.values()), name
        # the same result, or its async iterator where the sync client yields (annotations are strings here)
        assert a.return_annotation in (s.return_annotation, "Async" + s.return_annotation), name
        assert f.__doc__ == g.__doc__ or name == "aclose", name
