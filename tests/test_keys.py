"""Key naming: injective over (stream, group), each key in its stream's slot."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.crc import key_slot

from taskiq_atomic_claim.admin.dead_letters import list_dead_letters
from taskiq_atomic_claim.dead_letters import move_to_dead_letters
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import Server
from tests.test_cli import cli

# Names built from the characters that mean something in a key: braces
# decide the slot, colons and percent signs separate and encode.
names = st.text(
    alphabet=st.one_of(
        st.sampled_from("{}:%ab"), st.characters(exclude_categories=["Cs"])
    ),
    min_size=1,
)


def every_key(keys: StreamKeys) -> list[str]:
    return [keys.lease, keys.cursor, keys.dead_letters, keys.started, keys.reclaimed]


@settings(max_examples=2000, deadline=None)
@given(names, names, names, names)
@example("s", "g", "{s}", "g")
@example("a:b", "c", "a", "b:c")
@example("x{t}:y", "z", "x{t}", "y:z")
@example("a%3Ab", "g", "a:b", "g")
def test_distinct_pairs_never_share_a_key(
    stream: str, group: str, other_stream: str, other_group: str
) -> None:
    if (stream, group) == (other_stream, other_group):
        return
    ours = set(every_key(StreamKeys(stream, group)))
    theirs = set(every_key(StreamKeys(other_stream, other_group)))
    assert not ours & theirs


@settings(max_examples=2000, deadline=None)
@given(names, names)
@example("a{}b{c}", "g")
@example("a}b", "g")
@example("{}x", "g")
@example("{{a}", "g")
@example("jobs{eu}", "g")
def test_every_key_hashes_to_the_stream_slot(stream: str, group: str) -> None:
    keys = StreamKeys(stream, group)
    slot = key_slot(stream.encode())
    kinds = every_key(keys)
    assert len(set(kinds)) == len(kinds)
    for key in kinds:
        assert key_slot(key.encode()) == slot, key
        # The prefix and kind have no braces: the tag is the first {...}.
        assert key.index("{") > key.index(":")


async def dead_letter_one(redis: Redis, stream: str, group: str, data: bytes) -> None:
    await redis.xgroup_create(stream, group, id="0", mkstream=True)
    entry_id = text(await redis.xadd(stream, {"data": data}))
    await redis.xreadgroup(group, "c", {stream: ">"})
    keys = StreamKeys(stream, group)
    assert await move_to_dead_letters(
        ScriptRunner(), redis, keys, entry_id, "test", delete_acked=False
    )


async def test_requeue_moves_only_the_named_streams_dead_letters(
    server: Server, redis: Redis
) -> None:
    await dead_letter_one(redis, "s", "g", b"of s")
    await dead_letter_one(redis, "{s}", "g", b"of {s}")

    done = cli("requeue", "--url", server.url, "--queue", "s", "--group", "g", "--all")
    assert done.returncode == 0, done.stdout + done.stderr

    plain: Any = await redis.xrange("s")
    braced: Any = await redis.xrange("{s}")
    assert [fields[b"data"] for _, fields in plain] == [b"of s", b"of s"]
    assert [fields[b"data"] for _, fields in braced] == [b"of {s}"]
    left = await list_dead_letters(redis, StreamKeys("{s}", "g"))
    assert [letter.fields[b"data"] for letter in left] == [b"of {s}"]
