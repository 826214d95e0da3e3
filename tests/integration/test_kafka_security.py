"""Kafka security for real: the local broker with SASL_SSL (SCRAM-SHA-256) and ACLs.

One secured broker for the module, on free ports in a temporary folder, with certificates made
here by the JDK's keytool (a CA, and a broker certificate it signs for 127.0.0.1). The stack
(processor, gateway with the ClickHouse sinks, ingress), the store and a runner process work
through it as the project's user, the broker's one super user. Refused: clients without
credentials or with a wrong password, unauthenticated requests on the controller port, and an
authenticated user that no ACL allows anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed, TopicAuthorizationFailedError
from aiokafka.protocol.admin import CreateAclsRequest
from pydantic import SecretStr

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.errors import BrokerError, ConfigError
from agl_stream.kafka import broker, jars
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import Span
from agl_stream.ports import free_ports
from tests.integration.helpers import start_role, stop_role

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="no Java here"),
]

USER = "agl"
PASSWORD = f"pw-{uuid4().hex}"
STORE_PASSWORD = f"ks-{uuid4().hex}"  # keystores
AGENT = "tests.integration.agents:scripted"


def _keytool(*args: str, stdin: bytes | None = None) -> bytes:
    java = jars.check_prerequisites(maven=False).java.resolve()
    jvm = ["-J-XX:TieredStopAtLevel=1", "-J-XX:+UseSerialGC"]  # a short-lived JVM starts faster
    result = subprocess.run([str(java.parent / "keytool"), *jvm, *args], input=stdin, capture_output=True)
    assert result.returncode == 0, f"keytool {args[0]} failed: {result.stdout!r} {result.stderr!r}"
    return result.stdout


def _certificates(folder: Path) -> tuple[Path, Path]:
    """A CA and a broker certificate it signs for 127.0.0.1: (the CA's PEM, the broker's PKCS12 keystore)."""
    folder.mkdir()
    ca_store, keystore, ca_pem = folder / "ca.p12", folder / "broker.p12", folder / "ca.pem"

    def store(path: Path) -> list[str]:
        return ["-keystore", str(path), "-storetype", "PKCS12", "-storepass", STORE_PASSWORD]

    key = ["-genkeypair", "-keyalg", "EC", "-groupname", "secp256r1", "-validity", "2"]
    _keytool(*key, "-alias", "ca", "-dname", "CN=agl-test-ca", "-ext", "bc:c", *store(ca_store))
    _keytool(*key, "-alias", "broker", "-dname", "CN=localhost", *store(keystore))
    ca_pem.write_bytes(_keytool("-exportcert", "-rfc", "-alias", "ca", *store(ca_store)))
    request = _keytool("-certreq", "-alias", "broker", *store(keystore))
    signed = _keytool(
        *("-gencert", "-rfc", "-alias", "ca", "-validity", "2", "-ext", "SAN=ip:127.0.0.1,dns:localhost"),
        *store(ca_store),
        stdin=request,
    )
    # The reply with its chain (signed certificate, then the CA's) replaces the self-signed one.
    _keytool("-importcert", "-noprompt", "-alias", "broker", *store(keystore), stdin=signed + ca_pem.read_bytes())
    return ca_pem, keystore


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """The stack on a broker of its own that serves SASL_SSL only, as the project's user."""
    folder = tmp_path_factory.mktemp("secured")
    ca_pem, keystore = _certificates(folder / "tls")
    port, controller_port = free_ports(2)
    settings = Settings(
        kafka_bootstrap=None,
        data_dir=folder / "data",
        kafka_port=port,
        kafka_controller_port=controller_port,
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_sasl_username=USER,
        kafka_sasl_password=SecretStr(PASSWORD),
        kafka_ssl_cafile=ca_pem,
        kafka_broker_keystore=keystore,
        kafka_broker_keystore_password=SecretStr(STORE_PASSWORD),
        topic_prefix="sec",
        gateway_port=0,
    )
    broker.start(settings)
    try:
        stack.up(settings)
        try:
            yield stack.local_stack_settings(settings)
        finally:
            stack.down(settings)
    finally:
        broker.stop(settings)


def _span(rollout_id: str, attempt_id: str) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=1,
        trace_id=uuid4().hex,
        span_id=uuid4().hex[:16],
        name="secured.step",
        attributes={"ok": True},
        start_time=1.0,
        end_time=2.0,
    )


async def test_store_runner_and_sinks_work_through_sasl_ssl(secured: Settings) -> None:
    async with connect(**secured.model_dump(exclude_none=True)) as store:
        by_hand = await store.enqueue_rollout({"kind": "ok", "i": 1})
        claimed = await store.dequeue_rollout(worker_id="w-secured")
        assert claimed is not None and claimed.rollout_id == by_hand.rollout_id
        await store.add_span(_span(by_hand.rollout_id, claimed.attempt.attempt_id))
        await store.update_attempt(by_hand.rollout_id, "latest", status="succeeded")

        runner = start_role(secured, "runner", "--agent", AGENT, log_name="runner")
        try:
            by_runner = await store.enqueue_rollout({"kind": "ok", "i": 2})
            ids = [by_hand.rollout_id, by_runner.rollout_id]
            finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=120)
        finally:
            assert stop_role(runner, timeout=60) == 0
        assert [(r.rollout_id, r.status) for r in finished] == [(i, "succeeded") for i in ids]

        # Both rollouts' spans are in ClickHouse: the gateway's sink consumed them through SASL_SSL.
        assert store.side is not None
        await store.side.query("SELECT 1", fence=await fence_at_end(secured, "spans"))
        assert [s.name for s in await store.query_spans(by_hand.rollout_id, "latest")] == ["secured.step"]
        names = {s.name for s in await store.query_spans(by_runner.rollout_id, "latest")}
        assert {"agent.step", "tool.call"} <= names


def _refused_options(secured: Settings, client: str) -> dict[str, Any]:
    good = secured.kafka_client_options()
    bootstrap = good["bootstrap_servers"]
    return {
        "plaintext": {"bootstrap_servers": bootstrap, "security_protocol": "PLAINTEXT"},
        "tls-without-sasl": {
            "bootstrap_servers": bootstrap,
            "security_protocol": "SSL",
            "ssl_context": good["ssl_context"],
        },
        "wrong-password": {**good, "sasl_plain_password": "not-the-password"},
    }[client]


@pytest.mark.parametrize("client", ["plaintext", "tls-without-sasl", "wrong-password"])
async def test_a_client_without_valid_credentials_is_refused(secured: Settings, client: str) -> None:
    admin = AIOKafkaAdminClient(**_refused_options(secured, client), request_timeout_ms=10_000)
    try:
        with pytest.raises(KafkaConnectionError, match="Unable to bootstrap"):
            await admin.start()
    finally:
        await admin.close()


async def test_a_wrong_password_is_named_as_such(secured: Settings) -> None:
    good = secured.kafka_client_options()
    with pytest.raises(SaslAuthenticationFailed, match="Authentication failed"):  # the broker's own answer
        await create_conn(
            secured.kafka_host,
            secured.kafka_port,
            security_protocol="SASL_SSL",
            ssl_context=good["ssl_context"],
            sasl_mechanism=good["sasl_mechanism"],
            sasl_plain_username=USER,
            sasl_plain_password="not-the-password",
        )
    # `kafka start` / `up` with the wrong password say so at once instead of waiting for an answer.
    wrong = secured.model_copy(update={"kafka_bootstrap": None, "kafka_sasl_password": SecretStr("not-the-password")})
    with pytest.raises(BrokerError, match="refused the credentials of AGL_KAFKA_SASL_USERNAME=agl"):
        broker.start(wrong)


def test_the_broker_keeps_its_secrets_to_itself(secured: Settings) -> None:
    kafka_dir = secured.kafka_dir
    assert (kafka_dir / "server.properties").stat().st_mode & 0o077 == 0  # it holds the passwords
    assert not (kafka_dir / "format.args").exists()  # the salted password, for the format tool only
    pid = broker.status(secured).pid
    assert pid is not None
    command_line = Path(f"/proc/{pid}/cmdline").read_bytes() if Path("/proc/self").exists() else b""
    assert PASSWORD.encode() not in command_line and STORE_PASSWORD.encode() not in command_line


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kafka_security_protocol": "SASL_PLAINTEXT"}, "serves PLAINTEXT, or SASL_SSL with SCRAM"),
        ({"kafka_sasl_mechanism": "PLAIN"}, "serves PLAINTEXT, or SASL_SSL with SCRAM"),
        ({"kafka_broker_keystore": None}, "needs AGL_KAFKA_BROKER_KEYSTORE$"),
        ({"kafka_sasl_username": "a,b"}, "letters, digits and"),
        ({}, "AGL_KAFKA_BROKER_KEYSTORE=.* is not a file"),
    ],
)
def test_settings_the_local_broker_cannot_serve_are_refused_before_anything_runs(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    values: dict[str, object] = {
        "kafka_bootstrap": None,
        "data_dir": tmp_path,
        "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "SCRAM-SHA-512",
        "kafka_sasl_username": USER,
        "kafka_sasl_password": PASSWORD,
        "kafka_broker_keystore": tmp_path,  # not even a file: refused later than these
        "kafka_broker_keystore_password": STORE_PASSWORD,
        **changes,
    }
    with pytest.raises(ConfigError, match=message):
        broker.start(Settings(**values))  # type: ignore[arg-type]
    assert not (tmp_path / "kafka").exists()


async def test_the_controller_port_refuses_unauthenticated_requests(secured: Settings) -> None:
    # Before authenticating, a listener answers ApiVersions only. As a PLAINTEXT listener the
    # controller would take this from User:ANONYMOUS, a super user there (the broker registers
    # as it), and grant everyone everything.
    conn = await create_conn(secured.kafka_host, secured.kafka_controller_port, request_timeout_ms=10_000)
    try:
        grant_all = CreateAclsRequest(
            resource_type=4,  # cluster
            resource_name="kafka-cluster",
            resource_pattern_type_filter=3,  # literal
            principal="User:ANONYMOUS",
            host="*",
            operation=2,  # all
            permission_type=3,  # allow
        )
        with pytest.raises(KafkaConnectionError):
            await conn.send(grant_all)
    finally:
        conn.close()


def _add_scram_user(settings: Settings, name: str, password: str) -> None:
    """A SCRAM credential for ``name``, set by the project's user with Kafka's own kafka-configs tool."""
    client = settings.data_dir / "admin-client.properties"
    client.write_text(
        "security.protocol=SASL_SSL\n"
        f"sasl.mechanism={settings.kafka_sasl_mechanism}\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{USER}" password="{PASSWORD}";\n'
        f"ssl.truststore.type=PEM\nssl.truststore.location={settings.kafka_ssl_cafile}\n"
    )
    java = jars.check_prerequisites(maven=False).java
    result = subprocess.run(
        [
            *(str(java), "-XX:TieredStopAtLevel=1", "-cp", f"{jars.ensure_jars(settings)}/*"),
            *("kafka.admin.ConfigCommand", "--bootstrap-server", settings.bootstrap_servers),
            *("--command-config", str(client), "--alter", "--entity-type", "users", "--entity-name", name),
            *("--add-config", f"{settings.kafka_sasl_mechanism}=[iterations=8192,password={password}]"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def _topics(settings: Settings) -> set[str]:
    admin = AIOKafkaAdminClient(**settings.kafka_client_options())
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def test_an_authenticated_user_without_acls_is_refused(secured: Settings) -> None:
    password = uuid4().hex
    _add_scram_user(secured, "stranger", password)
    stranger = secured.model_copy(
        update={"kafka_sasl_username": "stranger", "kafka_sasl_password": SecretStr(password)}
    )
    spans = secured.topic("spans")

    producer = AIOKafkaProducer(**stranger.kafka_client_options(), request_timeout_ms=10_000)
    await producer.start()  # authenticated: the connection is accepted
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.send_and_wait(spans, b"not allowed", key=b"k")
    finally:
        await producer.stop()
    assert spans not in await _topics(stranger)  # not even visible to it
    assert spans in await _topics(secured)  # the project's user, a super user, sees and uses it
