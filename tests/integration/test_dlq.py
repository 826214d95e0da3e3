"""Dead letters end to end on the shared stack (processor, gateway, ingress): bad task requests
are dead-lettered by the ingress; `agl-stream dlq` lists, counts, shows and resubmits them; the
gateway's sink puts them in the dead_letters table; and a dead letter is decoded by tools that
are not agl-stream (fastavro and Apache Avro's Python package, in their own processes, from the
.avsc files `agl-stream schemas export` writes), as docs/dlq.md tells an operator to.

Sync tests: the CLI runs its own event loop (asyncio.run), as it does for a person.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner, Result

from agl_stream import connect
from agl_stream.cli.dlq_cmd import dlq_app
from agl_stream.cli.schemas_cmd import schemas_app
from agl_stream.config import Settings
from agl_stream.domain.dead_letters import RESUBMITTED_HEADER
from agl_stream.domain.ingress import rollout_id_for
from agl_stream.kafka.io import Outbox, Rejected
from agl_stream.kafka.offsets import end_offsets, fence_at_end
from agl_stream.models import LLM, DlqRecord, TaskRequest
from agl_stream.wire.codec import Codec
from tests.integration.helpers import dlq_records, read_to_end

pytestmark = pytest.mark.integration

CODEC = Codec.default()


def _cli(settings: Settings, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(dlq_app, list(args), obj=settings, input=stdin, env={"COLUMNS": "250"})


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


async def _produce(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await (await producer.send(settings.topic("task-requests"), value, key=key))
    finally:
        await producer.stop()


def _request(request_id: str, resources_id: str | None = None) -> bytes:
    return CODEC.encode(TaskRequest(request_id=request_id, input={"q": request_id}, resources_id=resources_id))


async def _total(settings: Settings, name: str) -> int:
    return sum((await end_offsets(settings, settings.topic(name))).values())


async def _sql(settings: Settings, sql: str) -> list[dict[str, Any]]:
    """Rows from the gateway, behind a fence at the end of agl.dlq (every dead letter so far applied)."""
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        assert store.side is not None
        result = await store.side.query(sql, fence=await fence_at_end(settings, "dlq"), timeout=120)
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


@pytest.fixture(scope="module")
def dead(stack_settings: Settings) -> dict[str, Any]:
    """Two bad task requests the ingress dead-letters: bytes that are no Avro, and a request
    naming a resources snapshot nobody published (yet)."""
    tag = uuid.uuid4().hex[:10]
    keys = {"garbage": f"garbage-{tag}", "resources": f"res-{tag}"}
    resources_id = f"rs-dlq-{tag}"
    values = {"garbage": b"\x00not avro \xff\\ at all", "resources": _request(keys["resources"], resources_id)}
    asyncio.run(_produce(stack_settings, [(keys[n].encode(), values[n]) for n in keys]))
    source = stack_settings.topic("task-requests")
    found = asyncio.run(
        dlq_records(
            stack_settings, 2, lambda r: r.source_topic == source and r.key in {k.encode() for k in keys.values()}
        )
    )
    by_key = {(r.key or b"").decode(): r for r in found}
    return {"tag": tag, "keys": keys, "values": values, "resources_id": resources_id, "records": by_key}


def _ids(settings: Settings, keys: dict[str, str]) -> dict[str, str]:
    listed = _json(_cli(settings, "list", "--json", "--source-topic", "task-requests", "--limit", "100000"))
    return {name: next(r["id"] for r in listed if r["key"] == key) for name, key in keys.items()}


def test_list_and_count_agree_with_the_topic(stack_settings: Settings, dead: dict[str, Any]) -> None:
    settings = stack_settings
    everything = [CODEC.decode(m.value, DlqRecord) for m in asyncio.run(read_to_end(settings, settings.topic("dlq")))]
    listed = _json(_cli(settings, "list", "--json", "--limit", "100000"))
    assert len(listed) == len(everything)
    times = [r["time"] for r in listed]
    assert times == sorted(times, reverse=True)  # newest first
    ours = {r["key"]: r for r in listed if r["key"] in dead["keys"].values()}
    garbage, resources = dead["records"][dead["keys"]["garbage"]], dead["records"][dead["keys"]["resources"]]
    row = ours[dead["keys"]["garbage"]]
    assert (row["source_topic"], row["source_offset"], row["error_type"], row["processor"]) == (
        settings.topic("task-requests"),
        garbage.source_offset,
        "NotSingleObjectEncodedError",
        "processor.ingress",
    )
    assert row["value_size"] == len(dead["values"]["garbage"])
    assert ours[dead["keys"]["resources"]]["reason"] == resources.reason
    # Filters: by reason substring (any case) and by source topic, short or full name.
    by_reason = _json(_cli(settings, "list", "--json", "--reason", "NAMES NO SNAPSHOT", "--limit", "100000"))
    assert dead["keys"]["resources"] in {r["key"] for r in by_reason}
    assert all("names no snapshot" in r["reason"] for r in by_reason)
    full = _json(_cli(settings, "list", "--json", "-t", settings.topic("task-requests"), "--limit", "100000"))
    short = _json(_cli(settings, "list", "--json", "-t", "task-requests", "--limit", "100000"))
    assert full == short and {r["source_topic"] for r in short} == {settings.topic("task-requests")}
    assert _json(_cli(settings, "list", "--json", "--limit", "1")) == listed[:1]
    assert _json(_cli(settings, "list", "--json", "--since", str(time.time() + 3600))) == []
    # Counting, against a count of the topic read independently.
    counted = _json(_cli(settings, "count", "--json"))
    expected = Counter((r.source_topic, r.processor, r.error_type) for r in everything)
    assert {(r["source_topic"], r["processor"], r["error_type"]): r["count"] for r in counted} == dict(expected)
    by_type = _json(_cli(settings, "count", "--json", "--by", "error_type"))
    assert {r["error_type"]: r["count"] for r in by_type} == dict(Counter(r.error_type for r in everything))
    table = _cli(settings, "count")
    assert table.exit_code == 0 and "NotSingleObjectEncodedError" in table.stdout
    bad = _cli(settings, "count", "--by", "colour")
    assert bad.exit_code != 0 and "choose from source_topic" in str(bad.exception)


def test_show_decodes_with_the_source_topics_schema_or_shows_the_bytes(
    stack_settings: Settings, dead: dict[str, Any]
) -> None:
    settings = stack_settings
    ids = _ids(settings, dead["keys"])
    shown = _json(_cli(settings, "show", ids["resources"], "--json"))
    assert shown["record_name"] == "agl.TaskRequest" and shown["problem"] is None
    assert shown["decoded"]["request_id"] == dead["keys"]["resources"]
    assert shown["decoded"]["resources_id"] == dead["resources_id"]
    text = _cli(settings, "show", ids["resources"])
    assert text.exit_code == 0 and "names no snapshot" in text.stdout and '"request_id"' in text.stdout
    garbage = _json(_cli(settings, "show", ids["garbage"], "--json"))
    assert garbage["record_name"] is None and "single-object marker" in garbage["problem"]
    assert bytes.fromhex(garbage["value_hex"]) == dead["values"]["garbage"]
    text = _cli(settings, "show", ids["garbage"])
    assert "00000000  00 6e 6f 74 20 61 76 72 6f 20 ff 5c" in text.stdout
    assert "escaped: \\x00not avro \\xff\\\\ at all" in text.stdout
    missing = _cli(settings, "show", "0:999999999")
    assert missing.exit_code != 0 and "no dead letter 0:999999999" in str(missing.exception)
    assert "names no dead letter" in str(_cli(settings, "show", "seven").exception)


def test_the_gateway_puts_dead_letters_in_the_dead_letters_table(
    stack_settings: Settings, dead: dict[str, Any]
) -> None:
    settings = stack_settings
    keys = "', '".join(dead["keys"].values())
    rows = asyncio.run(
        _sql(
            settings,
            "SELECT key, source_topic, source_offset, reason, error_type, processor, value_size, value_kept, "
            f"value_sha256 FROM agl.dead_letters FINAL WHERE key IN ('{keys}') ORDER BY key",
        )
    )
    assert len(rows) == 2
    for row in rows:
        record: DlqRecord = dead["records"][row["key"]]
        value = dead["values"]["garbage" if row["key"] == dead["keys"]["garbage"] else "resources"]
        assert (row["source_topic"], row["source_offset"], row["reason"], row["error_type"], row["processor"]) == (
            record.source_topic,
            record.source_offset,
            record.reason,
            record.error_type,
            record.processor,
        )
        assert (row["value_size"], row["value_kept"]) == (len(value), len(value))
        assert row["value_sha256"] == hashlib.sha256(value).hexdigest()
    # The table counts what the topic holds (every dead letter so far is behind the fence).
    everything = asyncio.run(read_to_end(settings, settings.topic("dlq")))
    [total] = asyncio.run(_sql(settings, "SELECT count() AS n FROM agl.dead_letters FINAL"))
    assert total["n"] == len(everything)


def test_tools_other_than_agl_stream_decode_a_dead_letter(
    stack_settings: Settings, dead: dict[str, Any], tmp_path: Path
) -> None:
    """docs/dlq.md's recipe: the exported .avsc files, the 10-byte single-object header cut off,
    the body read by fastavro or by Apache Avro's Python package; then the same for the rejected
    record it holds, its schema found by its header."""
    settings = stack_settings
    exported = CliRunner().invoke(schemas_app, ["export", "--dir", str(tmp_path / "avsc")])
    assert exported.exit_code == 0, exported.output
    ids = _ids(settings, dead["keys"])
    partition, offset = (int(x) for x in ids["resources"].split(":"))
    [message] = [
        m
        for m in asyncio.run(read_to_end(settings, settings.topic("dlq")))
        if (m.partition, m.offset) == (partition, offset)
    ]
    dumped = tmp_path / "dead-letter.bin"
    dumped.write_bytes(message.value)
    for tool in ("fastavro", "avro"):
        done = subprocess.run(
            [sys.executable, "-c", DECODE[tool], str(tmp_path / "avsc"), str(dumped)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        outer, inner = (json.loads(line) for line in done.stdout.splitlines())
        assert outer["source_topic"] == settings.topic("task-requests") and outer["reason"] == (
            dead["records"][dead["keys"]["resources"]].reason
        ), tool
        assert (inner["request_id"], inner["resources_id"]) == (dead["keys"]["resources"], dead["resources_id"]), tool


# What docs/dlq.md shows, as one program per tool: argv[1] the exported folder, argv[2] a record
# of agl.dlq; prints the dead letter, then the record it rejected (one JSON line each). Nothing
# of agl_stream is imported.
_COMMON = """
import io, json, sys
folder, path = sys.argv[1], sys.argv[2]
def schema_text(header):
    return open(f"{folder}/by-header/{header.hex()}.avsc").read()
def show(datum):
    print(json.dumps(datum, default=lambda b: b.hex()))
"""
DECODE = {
    "fastavro": _COMMON
    + """
import fastavro
def decode(data):
    schema = fastavro.parse_schema(json.loads(schema_text(data[:10])))
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), schema)
letter = decode(open(path, "rb").read())
show(letter)
show(decode(letter["value"]))
""",
    "avro": _COMMON
    + """
import warnings
import avro.io, avro.schema
warnings.simplefilter("ignore")  # it warns of the "json" logical type it does not know
def decode(data):
    schema = avro.schema.parse(schema_text(data[:10]))
    return avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
letter = decode(open(path, "rb").read())
show(letter)
show(decode(letter["value"]))
""",
}


def test_resubmit_refuses_foreign_topics_asks_first_and_sends_back(
    stack_settings: Settings, dead: dict[str, Any]
) -> None:
    """Last: it publishes the missing resources and resubmits both dead letters."""
    settings = stack_settings
    ids = _ids(settings, dead["keys"])
    # A dead letter from a topic that is not this stack's (written as a foreign writer would).
    foreign_topic = f"other{dead['tag']}.task-requests"

    async def foreign() -> None:
        async with Outbox.started(settings, "test") as outbox:
            error = ValueError("from another stack")
            await outbox.reject([Rejected(foreign_topic, 0, 5, b"k", dead["values"]["resources"], error)])

    asyncio.run(foreign())
    [foreign_id] = [
        r["id"]
        for r in _json(_cli(settings, "list", "--json", "-t", foreign_topic))
        if r["source_topic"] == foreign_topic
    ]
    before = asyncio.run(_total(settings, "task-requests"))
    refused = _cli(settings, "resubmit", foreign_id, "--yes")
    assert refused.exit_code == 1 and "is not one of this stack's topics" in refused.output
    assert _cli(settings, "resubmit").exit_code != 0  # nothing named: nothing sent
    dry = _cli(settings, "resubmit", ids["garbage"], ids["resources"], "--dry-run")
    assert dry.exit_code == 0 and "dry run: 2 record(s) would be sent" in dry.stdout
    assert "names no snapshot" in dry.stdout  # each with the reason it was rejected
    declined = _cli(settings, "resubmit", ids["garbage"], stdin="n\n")
    assert declined.exit_code == 1 and "nothing sent" in declined.stdout
    assert asyncio.run(_total(settings, "task-requests")) == before

    # The resources it named now exist: resubmitted, the request becomes a rollout; the garbage
    # is read again and dead-lettered again, at a new offset.
    async def publish() -> None:
        async with connect(**settings.model_dump(exclude_none=True)) as store:
            await store.update_resources(
                dead["resources_id"], {"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="m")}
            )

    asyncio.run(publish())
    sent = _cli(settings, "resubmit", ids["garbage"], ids["resources"], stdin="y\n")
    assert sent.exit_code == 0, sent.output
    # "sent <id> -> <topic> partition <p> offset <o>": a position is a partition and an offset
    # (the topic has several partitions, so an offset alone names a record in each of them).
    positions = {
        words[1]: (int(words[5]), int(words[7]))
        for words in (line.split() for line in sent.stdout.splitlines() if line.startswith("sent "))
    }
    assert set(positions) == {ids["garbage"], ids["resources"]}
    assert asyncio.run(_total(settings, "task-requests")) == before + 2

    async def outcome() -> list[Any]:
        async with connect(**settings.model_dump(exclude_none=True)) as store:
            deadline = time.monotonic() + 120
            wanted = rollout_id_for(dead["keys"]["resources"])
            while not (found := await store.query_rollouts(rollout_id_in=[wanted])):
                assert time.monotonic() < deadline, "the resubmitted request never became a rollout"
                await asyncio.sleep(0.2)
            return list(found)

    [rollout] = asyncio.run(outcome())
    assert rollout.resources_id == dead["resources_id"]
    source = settings.topic("task-requests")
    again = asyncio.run(
        dlq_records(
            settings,
            1,
            lambda r: r.source_topic == source and (r.source_partition, r.source_offset) == positions[ids["garbage"]],
            timeout=120,
        )
    )
    assert again[0].key == dead["keys"]["garbage"].encode() and again[0].value == dead["values"]["garbage"]
    resent = [
        m
        for m in asyncio.run(read_to_end(settings, source))
        if (m.partition, m.offset) == positions[ids["garbage"]] and m.key == again[0].key
    ]
    assert dict(resent[0].headers)[RESUBMITTED_HEADER] == f"{settings.topic('dlq')}:{ids['garbage']}".encode()
