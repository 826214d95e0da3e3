"""The local broker's security (``AGL_KAFKA_SECURITY_PROTOCOL=SASL_SSL``): the settings checked,
the listener, TLS, SCRAM and ACL properties of ``server.properties``, the SCRAM credential added
at format time, The controller listener stays on
127.0.0.1 behind SASL/PLAIN with a password made at each start.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import struct

from pydantic import SecretStr

from agl_stream.config import Settings
from agl_stream.errors import ConfigError

_SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
_SCRAM_ITERATIONS = 8192
_SCRAM_USER = re.compile(r"[A-Za-z0-9._-]+")  # also an unquoted JAAS option name (user_<name>)
_LOOPBACK = "127.0.0.1"


def secured(settings: Settings) -> bool:
    """Whether the broker is secured: SASL_SSL, the one protocol besides PLAINTEXT check_security allows."""
    return settings.kafka_security_protocol != "PLAINTEXT"


def controller_host(settings: Settings) -> str:
    """Secured, the controller listener (SASL/PLAIN without TLS) is on loopback only."""
    return _LOOPBACK if secured(settings) else settings.kafka_host


def _secret(value: SecretStr | None) -> str:
    return value.get_secret_value() if value is not None else ""


def check_security(settings: Settings) -> None:
    """Refuse, before anything runs, security settings the local broker cannot serve."""
    protocol, mechanism = settings.kafka_security_protocol, settings.kafka_sasl_mechanism
    if protocol == "PLAINTEXT":
        return
    if protocol != "SASL_SSL" or mechanism not in _SCRAM_MECHANISMS:
        raise ConfigError(
            f"the local Kafka broker serves PLAINTEXT, or SASL_SSL with SCRAM-SHA-256 or SCRAM-SHA-512, not "
            f"AGL_KAFKA_SECURITY_PROTOCOL={protocol} with AGL_KAFKA_SASL_MECHANISM={mechanism}; change them, "
            "or set AGL_KAFKA_BOOTSTRAP to use a cluster secured your way"
        )
    required = {
        "AGL_KAFKA_SASL_USERNAME": settings.kafka_sasl_username or "",
        "AGL_KAFKA_SASL_PASSWORD": _secret(settings.kafka_sasl_password),
        "AGL_KAFKA_BROKER_KEYSTORE": str(settings.kafka_broker_keystore or ""),
        "AGL_KAFKA_BROKER_KEYSTORE_PASSWORD": _secret(settings.kafka_broker_keystore_password),
    }
    missing = [name for name, value in required.items() if not value]
    if missing:
        raise ConfigError(f"a local Kafka broker with SASL_SSL needs {', '.join(missing)}")
    if not _SCRAM_USER.fullmatch(required["AGL_KAFKA_SASL_USERNAME"]):
        raise ConfigError(
            f"AGL_KAFKA_SASL_USERNAME={settings.kafka_sasl_username!r}: the local broker's user name may "
            "contain letters, digits and . _ - only"
        )
    for name, path in (
        ("AGL_KAFKA_BROKER_KEYSTORE", settings.kafka_broker_keystore),
        ("AGL_KAFKA_SSL_CAFILE", settings.kafka_ssl_cafile),
    ):
        if path is not None and not path.expanduser().is_file():
            raise ConfigError(f"{name}={path} is not a file")


def _jaas_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def security_properties(settings: Settings) -> dict[str, str]:
    """The SASL_SSL listener's TLS, SCRAM and ACL settings (the rest is in _server_properties)."""
    mechanism = str(settings.kafka_sasl_mechanism)
    user = str(settings.kafka_sasl_username)
    keystore = settings.kafka_broker_keystore
    assert keystore is not None  # check_security ran
    login = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f"username={_jaas_quoted(user)} password={_jaas_quoted(_secret(settings.kafka_sasl_password))};"
    )
    # The controller listener authenticates too: as a PLAINTEXT listener its callers would be
    # User:ANONYMOUS, which the broker's registration makes a super user, so any local process
    # could grant itself ACLs there. KRaft controllers take no SCRAM; PLAIN with a password made
    # for this start (the broker is the controller's only client) names the same user.
    controller_password = _jaas_quoted(secrets.token_urlsafe(24))
    controller_login = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f"username={_jaas_quoted(user)} password={controller_password} user_{user}={controller_password};"
    )
    props = {
        "sasl.enabled.mechanisms": mechanism,
        # The broker is a client of its own listener too (one node: inter-broker traffic goes to
        # itself), as the settings' user.
        "sasl.mechanism.inter.broker.protocol": mechanism,
        f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config": login,
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": controller_login,
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(keystore.expanduser().resolve()),
        "ssl.keystore.password": _secret(settings.kafka_broker_keystore_password),
        # ACLs: nobody but the settings' user may do anything without one.
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{user}",
    }
    if settings.kafka_ssl_cafile is not None:  # else the JDK's CAs, as the clients use the system's
        props["ssl.truststore.type"] = "PEM"
        props["ssl.truststore.location"] = str(settings.kafka_ssl_cafile.expanduser().resolve())
    return props


def scram_argument(settings: Settings) -> str:
    """``--add-scram`` for the settings' user: a salted password, never the password itself."""
    mechanism = str(settings.kafka_sasl_mechanism)
    salt = os.urandom(32)
    salted = hashlib.pbkdf2_hmac(
        mechanism.removeprefix("SCRAM-").replace("-", "").lower(),  # sha256 / sha512
        _secret(settings.kafka_sasl_password).encode(),
        salt,
        _SCRAM_ITERATIONS,
    )
    salt_b64, salted_b64 = base64.b64encode(salt).decode(), base64.b64encode(salted).decode()
    return (
        f'{mechanism}=[name={settings.kafka_sasl_username},salt="{salt_b64}",'
        f'saltedpassword="{salted_b64}",iterations={_SCRAM_ITERATIONS}]'
    )


def property_value(value: str) -> str:
    """``value`` escaped for java.util.Properties, which Kafka reads as ISO-8859-1."""
    escaped = []
    for index, char in enumerate(value):
        if char == "\\" or (char == " " and index == 0):
            escaped.append("\\" + char)
        elif " " <= char <= "~":
            escaped.append(char)
        else:
            units = struct.unpack(f">{len(char.encode('utf-16-be')) // 2}H", char.encode("utf-16-be"))
            escaped.extend(f"\\u{unit:04x}" for unit in units)
    return "".join(escaped)
