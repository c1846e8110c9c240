"""What the page's compare relies on, in plain asyncio: how many streams fair admission would start
for a client now (``FairAdmission.room``), and the merge of the rows' streams (``compare.merged``)."""

import asyncio

from cosyapp.engine.admission import FairAdmission
from cosyapp.web.ui.compare import merged


async def hold(admission: FairAdmission, client, release: asyncio.Event) -> None:
    async with admission.slot(client):
        await release.wait()


def test_room_is_the_free_slots_within_the_clients_own_cap():
    async def body():
        admission = FairAdmission(max_streams=8, max_waiting=16)  # four streams per client
        release = asyncio.Event()
        seen = [(admission.room("page"), admission.room("other"))]
        tasks = [asyncio.create_task(hold(admission, "page", release)) for _ in range(3)]
        await asyncio.sleep(0)
        seen.append((admission.room("page"), admission.room("other")))
        tasks += [asyncio.create_task(hold(admission, "other", release)) for _ in range(4)]
        await asyncio.sleep(0)
        seen.append((admission.room("page"), admission.room("other"), admission.room(None)))
        tasks += [asyncio.create_task(hold(admission, "page", release)) for _ in range(2)]  # one waits
        await asyncio.sleep(0)
        seen.append((admission.room("third"), admission.waiting))
        release.set()
        await asyncio.gather(*tasks)
        seen.append((admission.room("page"), admission.room(None)))
        return seen

    assert asyncio.run(body()) == [(4, 4), (1, 4), (1, 0, 1), (0, 1), (4, 4)]


async def items(name: str, count: int, pause: float, fail: bool = False):
    for i in range(count):
        await asyncio.sleep(pause)
        yield f"{name}{i}"
    if fail:
        raise ValueError(f"{name} failed")


def test_merged_interleaves_the_streams_and_ends_each_with_none_or_its_error():
    async def body():
        streams = {1: items("a", 3, 0.01), 2: items("b", 2, 0.015, fail=True), 3: items("c", 0, 0)}
        return [
            (key, str(item) if isinstance(item, Exception) else item) async for key, item in merged(streams)
        ]

    seen = asyncio.run(body())
    assert [item for key, item in seen if key == 1] == ["a0", "a1", "a2", None]
    assert [item for key, item in seen if key == 2] == ["b0", "b1", "b failed"]
    assert [item for key, item in seen if key == 3] == [None]
    assert seen.index((2, "b0")) < seen.index((1, "a2"))  # as they come, not one stream after another


def test_closing_the_merge_closes_every_stream():
    closed: list[str] = []

    async def endless(name: str):
        try:
            while True:
                await asyncio.sleep(0.01)
                yield name
        finally:
            closed.append(name)

    async def body():
        merge = merged({1: endless("a"), 2: endless("b")})
        first = await anext(merge)
        await merge.aclose()
        return first

    assert asyncio.run(body())[1] in ("a", "b")
    assert sorted(closed) == ["a", "b"]
