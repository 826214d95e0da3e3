"""Whether a Kafka broker answers: a Metadata request over a plain socket, or through aiokafka over
TLS and SCRAM when the settings secure the listener (the local broker's start-up and status).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from concurrent.futures import ThreadPoolExecutor

from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError, SaslAuthenticationFailed
from aiokafka.protocol.metadata import MetadataRequest

from agl_stream.config import Settings
from agl_stream.errors import BrokerError
from agl_stream.kafka.security import secured

__all__ = ["answering", "is_answering", "is_answering_secured"]


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        data += chunk
    return bytes(data)


def is_answering(host: str, port: int, *, timeout: float = 1.0) -> bool:
    """Whether a broker at host:port answers Metadata listing at least one unfenced broker.

    A plain PLAINTEXT request, so it works from sync code and inside a running event loop.
    A broker accepts requests shortly before the controller unfences it, and only unfenced
    brokers are listed; waiting for one means topics can be created right away.
    """
    client_id = b"agl-probe"
    # Request header v1 (api_key 3 = Metadata, version 4: the oldest Kafka 4 still serves),
    # then the v4 body: an empty topic array, allow_auto_topic_creation = false.
    body = struct.pack(">hhih", 3, 4, 1, len(client_id)) + client_id + struct.pack(">ib", 0, 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            # correlation id, throttle_time_ms, then the broker array's length
            correlation, _throttle, brokers = struct.unpack(">iii", _recv_exact(sock, 12))
            _recv_exact(sock, size - 12)
    except (OSError, struct.error):
        return False
    return correlation == 1 and brokers > 0


def answering(settings: Settings, host: str, port: int, *, timeout: float = 1.0) -> bool:
    """is_answering as the settings' clients connect; a TLS and SCRAM handshake get 5x the time."""
    if secured(settings):
        return is_answering_secured(settings, host, port, timeout=5 * timeout)
    return is_answering(host, port, timeout=timeout)


def is_answering_secured(settings: Settings, host: str, port: int, *, timeout: float = 1.0) -> bool:
    """is_answering over the SASL_SSL listener, as the settings' user (TLS, SCRAM, Metadata).

    Raises BrokerError when the broker refuses the credentials or its certificate does not
    verify: waiting longer would not help. Runs its own event loop in a thread, so it works
    from sync code and inside a running event loop alike.
    """
    options = settings.kafka_client_options()

    async def probe() -> int:
        conn = await create_conn(
            host,
            port,
            client_id="agl-probe",
            request_timeout_ms=int(timeout * 1000),
            security_protocol=options["security_protocol"],
            ssl_context=options.get("ssl_context"),
            sasl_mechanism=options["sasl_mechanism"],
            sasl_plain_username=options["sasl_plain_username"],
            sasl_plain_password=options["sasl_plain_password"],
        )
        try:
            response = await conn.send(MetadataRequest([]))  # no topics: just the live brokers
        finally:
            conn.close()
        return len(response.brokers)

    try:
        with ThreadPoolExecutor(1) as pool:
            brokers = pool.submit(asyncio.run, asyncio.wait_for(probe(), timeout)).result()
    except SaslAuthenticationFailed as exc:
        raise BrokerError(
            f"the local Kafka broker on {host}:{port} refused the credentials of AGL_KAFKA_SASL_USERNAME="
            f"{settings.kafka_sasl_username} ({exc}). The user and password are stored when the data dir is "
            f"first formatted ({settings.kafka_dir / 'data'}): use the ones it was formatted with, or "
            f"start on a new data dir"
        ) from exc
    except ssl.SSLCertVerificationError as exc:
        raise BrokerError(
            f"the certificate of the local Kafka broker on {host}:{port} did not verify ({exc.verify_message}): "
            "AGL_KAFKA_SSL_CAFILE must name the CA that signed the certificate in AGL_KAFKA_BROKER_KEYSTORE, "
            f"and that certificate must be issued for {host}"
        ) from exc
    except (OSError, KafkaError, asyncio.TimeoutError):
        return False  # not listening yet, or still starting
    return brokers > 0
