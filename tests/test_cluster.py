"""Serving from two replicas through Ray Serve (``--replicas 2``; cosyapp/cluster/): a local Ray
instance, the tiny model in each replica, built by the app's own code path, the real HTTP app in
front of them."""

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from test_server import SHORT, VOICE, make_service, wait_until

from cosyapp.engine.request import SynthesisRequest
from cosyapp.errors import BusyError, TextError
from cosyapp.settings import parse_settings
from cosyapp.web.ui.panel import stat_tiles

# Long enough that a stream is still running when its replica is killed after its first chunk.
STORY = " ".join(f"Sentence number {n} of a story told slowly." for n in range(1, 13))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def service(local_ray, tmp_path_factory):
    # Its own data folder: voices saved by other modules, with previews of their models, would be
    # queued for new previews at start, and those requests would run on the replicas meanwhile.
    return make_service(tmp_path_factory, replicas=2, data_dir=tmp_path_factory.mktemp("cluster-data"))


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def replicas(client) -> list[dict]:
    health = client.get("/health").json()
    return health["replicas"]


def requests_by_replica(client) -> list[int | None]:
    """Requests each replica has taken, as /health reports them."""
    return [line["requests"] for line in replicas(client)]


def speech(url: str, **body) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.post(
            "/v1/audio/speech", json={"input": SHORT, "voice": VOICE, "response_format": "wav", **body}
        )


def test_health_and_metrics_show_each_replica(client):
    health = client.get("/health").json()
    assert health["status"] == "serving"
    assert health["max_streams"] == 2 * 4  # the admission runs over both replicas' slots
    assert [(r["replica"], r["status"], r["device"]) for r in health["replicas"]] == [
        (0, "serving", "cpu"),
        (1, "serving", "cpu"),
    ]
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    up = {s.labels["replica"]: s.value for s in families["cosyapp_replica_up"].samples}
    assert up == {"0": 1.0, "1": 1.0}
    assert {s.labels["replica"] for s in families["cosyapp_replica_active_streams"].samples} == {"0", "1"}


def test_the_live_panel_shows_each_replica(service):
    tiles = stat_tiles(service.pipeline.metrics.snapshot())
    assert "replica 0" in tiles and "replica 1" in tiles
    assert tiles.count("0 streams · 0 jobs") == 2


def test_whole_clips_spread_over_both_replicas(client, url):
    before = requests_by_replica(client)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda seed: speech(url, seed=seed), range(4)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    wait_until(lambda: sum(requests_by_replica(client)) == sum(before) + 4)
    after = requests_by_replica(client)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_a_stream_comes_from_one_replica(client, url):
    before = requests_by_replica(client)
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"input": STORY[:200], "voice": VOICE, "stream": True, "response_format": "pcm"}
        with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            pieces = [piece for piece in response.iter_bytes() if piece]
    assert len(pieces) > 1 and sum(map(len, pieces)) > 0
    wait_until(lambda: sum(requests_by_replica(client)) == sum(before) + 1)
    grew = [a - b for a, b in zip(requests_by_replica(client), before, strict=True)]
    assert sorted(grew) == [0, 1]


def test_either_replica_makes_the_same_clip_for_the_page_and_the_api(client, url):
    body = {"input": SHORT, "voice": VOICE, "seed": 9, "response_format": "wav"}  # the page's files are WAV
    wait_until(lambda: all(line["queued_jobs"] == 0 for line in replicas(client)))  # both idle
    before = requests_by_replica(client)
    clips = [client.post("/v1/audio/speech", json=body) for _ in range(2)]
    assert [clip.status_code for clip in clips] == [200, 200]
    wait_until(lambda: sum(requests_by_replica(client)) == sum(before) + 2)
    assert [a - b for a, b in zip(requests_by_replica(client), before, strict=True)] == [1, 1]
    assert clips[0].content == clips[1].content
    page = Client(url, download_files=False, verbose=False)
    try:  # the page's form: text, voice, recording, transcript, speed, seed, session
        _, _, file = page.predict(SHORT, VOICE, None, "", 1.0, 9, "", api_name="/speak_clip")
    finally:
        page.close()
    assert httpx.get(file["url"], timeout=60).content == clips[0].content


def test_a_replica_refusal_crosses_to_the_ingress_as_itself(service):
    # The ingress checks the request rules first; what only a replica can find (its text frontend's
    # errors, a full replica) comes back the same way, as the stream's last item.
    voice = service.voices.get(VOICE)
    handle = service.pipeline.replicas[0].handle.options(stream=True)

    async def items() -> list:
        return [item async for item in handle.stream.remote(SynthesisRequest("   ", voice))]

    (error,) = asyncio.run(items())
    assert type(error) is TextError
    assert str(error) == "The text is empty: type what the voice should say."
    assert error.param == "input"


def test_a_closed_stream_ends_its_work_on_the_replica(service):
    pipeline = service.pipeline
    voice = service.voices.get(VOICE)

    async def scenario() -> int:
        stream = pipeline.stream(SynthesisRequest(STORY, voice, seed=4))
        await anext(stream)
        replica = next(r for r in pipeline.replicas if r.streams == 1)
        await stream.aclose()
        return replica.index

    index = asyncio.run(scenario())
    replica = pipeline.replicas[index]
    wait_until(lambda: replica.report["metrics"]["cancelled"] == 1)
    wait_until(lambda: replica.report["health"]["active_streams"] == 0)  # its admission slot is free


def test_a_killed_replica_fails_only_its_own_stream(service, client, url):
    pipeline = service.pipeline
    voice = service.voices.get(VOICE)

    async def scenario() -> tuple[BusyError | None, int, int]:
        doomed = pipeline.stream(SynthesisRequest(STORY, voice, seed=1, client="a"))
        await anext(doomed)
        victim = next(r for r in pipeline.replicas if r.streams == 1)
        survivor = pipeline.stream(SynthesisRequest(STORY, voice, seed=2, client="b"))
        await anext(survivor)
        assert victim.streams == 1, "the second stream went to the other replica"
        ray.kill(ray.get_actor(victim.report["actor"], namespace="serve"))
        failure = None
        async with contextlib.aclosing(doomed):
            try:
                async for _ in doomed:
                    pass
            except BusyError as error:
                failure = error
        survived = 1 + len([chunk async for chunk in survivor])
        return failure, victim.index, survived

    failure, victim, survived = asyncio.run(scenario())
    assert failure is not None, "the killed replica's stream ended without an error"
    assert str(failure).startswith(f"Replica {victim}, which was making this audio, stopped; try again")
    assert survived > 1
    lines = replicas(client)
    assert lines[victim]["status"] == "down" and lines[1 - victim]["status"] == "serving"
    response = speech(url, seed=3)  # a new request, while the victim restarts: the other serves it
    assert response.status_code == 200, response.text
    # Serve starts the killed replica again; once it reports, it takes requests again.
    wait_until(lambda: all(line["status"] == "serving" for line in replicas(client)), timeout=150)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    faults = {s.labels["replica"]: s.value for s in families["cosyapp_replica_faults"].samples}
    assert faults == {str(victim): 1.0, str(1 - victim): 0.0}


def test_the_flags_and_their_variables(monkeypatch, capsys):
    assert (parse_settings([]).replicas, parse_settings([]).gpus_per_replica) == (1, None)
    monkeypatch.setenv("COSYAPP_REPLICAS", "3")
    monkeypatch.setenv("COSYAPP_GPUS_PER_REPLICA", "0.5")
    assert (parse_settings([]).replicas, parse_settings([]).gpus_per_replica) == (3, 0.5)
    assert parse_settings(["--replicas", "2", "--gpus-per-replica", "1"]).gpus_per_replica == 1.0
    for flags, message in [
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--gpus-per-replica", "-1"], "--gpus-per-replica must be 0 or more"),
    ]:
        with pytest.raises(SystemExit):
            parse_settings(flags)
        assert message in capsys.readouterr().err
