"""The Python client against a real server: every endpoint, sync and async, and the error paths."""

import asyncio

import pytest

from lethe.clients.client import AsyncLethe, Lethe, LetheConnectionError, LetheError
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from live_server import ADMIN_KEY, running_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(load_model(tiny_model_dir), tmp_path_factory.mktemp("data")) as url:
        yield url


def test_every_endpoint_through_the_sync_client(server, sets):
    folder, forget, retain = sets
    admin = Lethe(server, key=ADMIN_KEY)
    tenant = admin.create_tenant("client-a")
    assert tenant.api_key.startswith("lk_") and admin.create_key("client-a").api_key != tenant.api_key
    with Lethe(server, key=tenant.api_key) as c:
        assert c.health() == {"status": "ok"} and c.ready()["status"] == "ready"
        f = c.upload_dataset(folder / "forget.jsonl")
        r = c.upload_dataset((folder / "retain.jsonl").read_bytes(), name="retain")
        assert (f.records, f.name, r.records, r.name) == (20, "forget.jsonl", 60, "retain")
        assert {d.id for d in c.list_datasets()} == {f.id, r.id} and c.get_dataset(f.id).sha256 == f.sha256
        seen = []
        job = c.wait(c.train_head(f.id, r.id, rank=8), on_progress=seen.append)
        assert job.status == "succeeded" and seen[-1].progress == 1.0 and job.head
        head = c.get_head(job.head)
        assert head.rank == 8 and [h.id for h in c.list_heads()] == [head.id]
        assert c.get_job(job.id).head == head.id and [j.id for j in c.list_jobs()] == [job.id]
        p = c.set_profile("forget", head=head.id, note="v1")
        p2 = c.set_profile("forget", head=head.id, preset="paper")
        assert (p.version, p2.version) == (1, 2) and c.rollback_profile("forget").version == 1
        assert c.rollback_profile("forget", version=2).version == 2
        assert [x.name for x in c.list_profiles()] == ["forget"] and len(c.get_profile("forget").history) == 2
        prompt = question_prompt(retain[0]["question"])
        out = c.generate(prompt, profile="forget", temperature=0, max_new_tokens=40)
        assert out.profile.name == "forget" and out.profile.version == 2
        assert "".join(c.stream_generate(prompt, temperature=0, max_new_tokens=40)) == \
            c.generate(prompt, temperature=0, max_new_tokens=40).text
        assert {m["id"] for m in c.models()["data"]} == {"base", "forget"}
        c.rollback_profile("forget", version=1)
        base_report = c.wait(c.evaluate(f.id, r.id)).metrics
        tilted = c.wait(c.evaluate(f.id, r.id, "forget", seeds=[0])).metrics
        assert tilted["profile"] == "forget" and tilted["forget"]["rouge_sampled"] is not None
        assert tilted["forget"]["rouge"] < 0.6 * base_report["forget"]["rouge"]
        assert tilted["retain"]["rouge"] >= 0.9 * base_report["retain"]["rouge"]  # a rank-8 head on the tiny model
        with pytest.raises(LetheError) as e:
            c.evaluate(f.id, r.id, "no-such-profile")
        assert e.value.status == 404
        asu = c.wait(c.train_asu(f.id, r.id, steps=10, layers="0"))
        assert c.get_asu(asu.weights).layers == [0] and len(c.list_asu()) == 1
        c.delete_profile("forget")
        c.delete_asu(asu.weights)
        c.delete_head(head.id)
        c.delete_dataset(f.id)
        assert c.list_heads() == [] and c.list_asu() == [] and [d.id for d in c.list_datasets()] == [r.id]


def test_errors_carry_the_status_and_the_servers_message(server):
    tenant = Lethe(server, key=ADMIN_KEY).create_tenant("client-b")
    with Lethe(server, key=tenant.api_key) as c:
        with pytest.raises(LetheError) as e:
            c.get_head("head_missing")
        assert e.value.status == 404 and "not found" in e.value.message
        with pytest.raises(LetheError) as e:
            c.upload_dataset(b'{"question": "q"}\n')
        assert e.value.status == 422 and "line 1.answer" in e.value.message
        with pytest.raises(LetheError) as e:
            c.generate("Question: x\nAnswer:", top_p=2)
        assert e.value.status == 422 and "top_p" in e.value.message
        d = c.upload_dataset(b'{"prompt": "p", "completion": "c"}\n')
        with pytest.raises(LetheError) as e:
            c.evaluate(d.id, d.id)
        assert e.value.status == 422 and "TOFU" in e.value.message
        with pytest.raises(LetheError) as e:
            c.cancel_job("job_missing")
        assert e.value.status == 404
        with pytest.raises(LetheError) as e:
            list(c.stream_generate("Question: x\nAnswer:", profile="nope"))
        assert e.value.status == 404
    with pytest.raises(LetheError) as e:
        Lethe(server, key="lk_wrong").list_datasets()
    assert e.value.status == 401
    with pytest.raises(LetheError) as e:
        Lethe(server, key=tenant.api_key).create_tenant("x")
    assert e.value.status == 403


def test_async_client(server, sets):
    folder, forget, retain = sets

    async def run():
        tenant = await AsyncLethe(server, key=ADMIN_KEY).create_tenant("client-c")
        async with AsyncLethe(server, key=tenant.api_key) as c:
            f = await c.upload_dataset(folder / "forget.jsonl")
            r = await c.upload_dataset(folder / "retain.jsonl")
            started = await c.train_head(f.id, r.id)
            with pytest.raises(TimeoutError):
                await c.wait(started, timeout=0.001)  # the job goes on
            job = await c.wait(started, timeout=120)
            await c.set_profile("p", head=job.head)
            prompt = question_prompt(forget[1]["question"])
            plain = await c.generate(prompt, temperature=0)
            streamed = "".join([t async for t in c.stream_generate(prompt, temperature=0)])
            tilted = await c.generate(prompt, profile="p", temperature=0)
            with pytest.raises(LetheError):
                await c.get_dataset("ds_missing")
            return plain, streamed, tilted

    plain, streamed, tilted = asyncio.run(run())
    assert plain.text == streamed and plain.text.strip() == forget[1]["answer"] and tilted.text != plain.text


def test_an_unreachable_server_is_a_lethe_error():
    with pytest.raises(LetheConnectionError) as e:
        Lethe("http://127.0.0.1:9", timeout=5).list_datasets()
    assert isinstance(e.value, LetheError) and e.value.status == 0 and "127.0.0.1:9" in e.value.message
    with pytest.raises(LetheConnectionError):
        list(Lethe("http://127.0.0.1:9", timeout=5).stream_generate("hi"))

    async def run():
        async with AsyncLethe("http://127.0.0.1:9", timeout=5) as c:
            await c.health()

    with pytest.raises(LetheConnectionError):
        asyncio.run(run())
