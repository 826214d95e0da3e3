"""The local broker's toolchain: Java 17+ and Maven found and checked, and the Kafka server jars
resolved with Maven into a cache (``settings.kafka_libs_dir``), completed atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from agl_stream.config import KAFKA_VERSION, Settings
from agl_stream.errors import BrokerError, PrerequisiteError
from agl_stream.logs import get_logger
from agl_stream.resources import resource_path

__all__ = ["MIN_JAVA", "Toolchain", "check_prerequisites", "ensure_jars", "java_major_version"]

log = get_logger("agl_stream.kafka.broker")

MIN_JAVA = 17
_JARS_MARKER = ".agl-complete"
_TAIL_LINES = 40

_JAVA_HINT = (
    "install a Java 17+ JDK, e.g. `apt-get install openjdk-17-jdk-headless` "
    "(macOS: `brew install openjdk@17`), or set JAVA_HOME to one"
)
_MAVEN_HINT = "install Apache Maven, e.g. `apt-get install maven` (macOS: `brew install maven`)"
_EXTERNAL_HINT = "or set AGL_KAFKA_BOOTSTRAP to use an existing Kafka cluster instead"


@dataclass(frozen=True)
class Toolchain:
    """The tools check_prerequisites() found."""

    java: Path
    java_version: int
    mvn: Path | None


def tail(text: str, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of a tool's output or log, for an error message."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


# -- prerequisites --------------------------------------------------------------------------


def _find_java() -> Path:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        raise PrerequisiteError(
            f"JAVA_HOME={java_home} has no executable bin/java: point JAVA_HOME at a Java "
            f"{MIN_JAVA}+ JDK or unset it to use `java` from PATH"
        )
    found = shutil.which("java")
    if found is None:
        raise PrerequisiteError(
            f"the local Kafka broker needs Java {MIN_JAVA}+ but `java` is not on PATH: {_JAVA_HINT}; {_EXTERNAL_HINT}"
        )
    return Path(found)


def java_major_version(java: Path) -> int:
    """Major version from ``java -version`` (``"1.8.0_292"`` -> 8, ``"17.0.15"`` -> 17)."""
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PrerequisiteError(f"could not run `{java} -version` ({exc}): {_JAVA_HINT}") from exc
    text = out.stderr + out.stdout  # the version goes to stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if match is None:
        raise PrerequisiteError(
            f"could not read the Java version from `{java} -version` (got {text.strip()[:200]!r}): {_JAVA_HINT}"
        )
    major = int(match.group(1))
    if major == 1 and match.group(2):  # pre-9 scheme: 1.8 is Java 8
        major = int(match.group(2))
    return major


def _find_maven() -> Path:
    found = shutil.which("mvn")
    if found is None:
        raise PrerequisiteError(
            f"fetching the Kafka server jars needs Apache Maven but `mvn` is not on PATH: "
            f"{_MAVEN_HINT}; {_EXTERNAL_HINT}"
        )
    return Path(found)


def check_prerequisites(*, maven: bool = True) -> Toolchain:
    """Java 17+ (JAVA_HOME first, then PATH) and, unless ``maven=False``, ``mvn`` on PATH."""
    java = _find_java()
    major = java_major_version(java)
    if major < MIN_JAVA:
        raise PrerequisiteError(
            f"{java} is Java {major}; the Kafka {KAFKA_VERSION} broker needs Java {MIN_JAVA}+: {_JAVA_HINT}"
        )
    return Toolchain(java=java, java_version=major, mvn=_find_maven() if maven else None)


# -- jars -----------------------------------------------------------------------------------


def _pom_digest(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def _jars_complete(libs: Path, digest: str) -> bool:
    """The marker is written last, names the pom it came from and every jar copied."""
    try:
        marker = json.loads((libs / _JARS_MARKER).read_text())
    except (OSError, ValueError):
        return False
    jars = marker.get("jars") if isinstance(marker, dict) else None
    return (
        marker.get("pom_sha256") == digest
        and isinstance(jars, list)
        and bool(jars)
        and all((libs / str(name)).is_file() for name in jars)
    )


def ensure_jars(settings: Settings) -> Path:
    """Resolve the Kafka server jars with Maven into ``settings.kafka_libs_dir`` (cached)."""
    pom = resource_path("infra/kafka/pom.xml")
    digest = _pom_digest(pom)
    libs = settings.kafka_libs_dir.expanduser().resolve()
    if _jars_complete(libs, digest):
        return libs
    tools = check_prerequisites()
    assert tools.mvn is not None
    libs.parent.mkdir(parents=True, exist_ok=True)
    # Copy into a private folder and rename it into place when complete: an interrupted copy
    # leaves no half-filled libs dir behind, and two processes resolving at once don't mix.
    staging = libs.parent / f".{libs.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    log.info("resolving kafka jars with maven", libs=str(libs), pom=str(pom))
    try:
        result = subprocess.run(
            [
                str(tools.mvn),
                "-q",
                "-B",
                "-Dstyle.color=never",
                "-f",
                str(pom),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
                "-DincludeScope=runtime",
            ],
            capture_output=True,
            text=True,
            check=False,
            cwd=libs.parent,
        )
        if result.returncode != 0:
            raise BrokerError(
                f"Maven could not resolve the Kafka jars (exit {result.returncode}); is Maven "
                f"Central reachable (or a mirror in ~/.m2/settings.xml)? Last lines:\n"
                f"{tail(result.stdout + result.stderr)}"
            )
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if not any(name.startswith("kafka_2.13-") for name in jars):
            raise BrokerError(f"Maven finished but copied no Kafka server jar into {staging}")
        (staging / _JARS_MARKER).write_text(json.dumps({"pom_sha256": digest, "jars": jars}))
        if libs.exists() and not _jars_complete(libs, digest):
            shutil.rmtree(libs)  # an older or half-finished copy
        try:
            staging.rename(libs)
        except OSError:
            if not _jars_complete(libs, digest):  # no concurrent resolver won: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("kafka jars ready", libs=str(libs), seconds=round(time.monotonic() - started, 1))
    return libs
