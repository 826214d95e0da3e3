"""infra/docker-compose.yml and infra/Dockerfile, checked against the code without Docker.

CI cannot run containers here, so this reads the compose file (PyYAML, which resolves its
anchors and merge keys as compose does) and checks what would break a `docker compose up`
silently: commands and flags the CLI does not have, settings agl-stream does not read, topic
names that are not declared, a Kafka version other than the local broker's, a cluster that is
not three brokers at replication 3 / min ISR 2, dependencies on services that do not exist,
ports published beyond loopback, listeners beyond loopback without the API token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml  # type: ignore[import-untyped]  # PyYAML (the dev extra) ships no types

from agl_stream.cli import _root
from agl_stream.cli.commands import register
from agl_stream.config import KAFKA_VERSION, SECRETS_DIR_ENV, Settings
from agl_stream.topics import load_topic_specs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
ENTRYPOINT = ROOT / "infra" / "docker-entrypoint.sh"

AGL_IMAGE = "agl-stream:"
"""Services whose image starts with this run the agl-stream image built from infra/Dockerfile."""
STORE_ROLES = {"processor", "gateway", "ingress", "triplets", "batcher"}
TRAINING_ROLES = {"trainer", "inference", "llm-proxy", "runner"}
KAFKA_NODES = 3


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose["services"]
    assert isinstance(found, dict)
    return found


@pytest.fixture(scope="module")
def cli() -> Any:
    """The ``agl-stream`` command tree (a click group; typer vendors its own click), built afresh:
    the installed app registers its commands only when it runs."""
    app = typer.Typer()
    app.callback()(_root)
    register(app)
    group = typer.main.get_command(app)
    assert _is_group(group)
    return group


def _is_group(command: Any) -> bool:
    return hasattr(command, "get_command") and hasattr(command, "commands")


def _options(command: Any) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _agl_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if str(s.get("image", "")).startswith(AGL_IMAGE)}


def _kafka_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if str(s.get("image", "")).startswith("apache/kafka:")}


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping"
    return {str(k): str(v) for k, v in env.items()}


def _resolve(cli: Any, argv: list[str]) -> tuple[Any, list[str]]:
    """The command ``agl-stream argv...`` runs, and the arguments left for it (root options checked)."""
    root_options = _option_names(cli)
    args = list(argv)
    while args and args[0].startswith("-"):
        name = args.pop(0).split("=", 1)[0]
        assert name in root_options, f"agl-stream has no global option {name}"
        if "=" not in name and not _is_flag(cli, name):
            args.pop(0)
    command: Any = cli
    while _is_group(command):
        assert args, f"{argv}: names a group, not a command"
        sub = command.commands.get(args[0])
        assert sub is not None, f"agl-stream has no command {args[0]!r} (in {argv})"
        command, args = sub, args[1:]
    return command, args


def _option_names(command: Any) -> set[str]:
    return {opt for p in _options(command) for opt in (*p.opts, *p.secondary_opts)}


def _is_flag(command: Any, name: str) -> bool:
    return any(p.is_flag and name in (*p.opts, *p.secondary_opts) for p in _options(command))


def _all_envvars(command: Any) -> set[str]:
    """AGL_* variables that CLI options read themselves (e.g. the LLM proxy's backend key)."""
    names: set[str] = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else list(envvar or []))
    if _is_group(command):
        for sub in command.commands.values():
            names |= _all_envvars(sub)
    return names


def test_every_role_command_is_a_real_command_with_real_options(services: dict[str, dict[str, Any]], cli: Any) -> None:
    agl = _agl_services(services)
    assert STORE_ROLES | TRAINING_ROLES <= set(agl), "every role has a service"
    for name, service in agl.items():
        argv = service["command"]
        assert isinstance(argv, list) and argv[0] == "agl-stream", f"{name}: command is ['agl-stream', ...]"
        command, args = _resolve(cli, [str(a) for a in argv[1:]])
        options = _option_names(command)
        for arg in args:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in options, f"{name}: `agl-stream {command.name}` has no option {arg}"
        # The options parse (types, ranges, choices) as the command would take them.
        ctx = command.make_context(str(command.name), list(args), resilient_parsing=False)
        ctx.close()


def test_roles_run_the_command_they_are_named_after(services: dict[str, dict[str, Any]]) -> None:
    for name in STORE_ROLES | TRAINING_ROLES:
        assert services[name]["command"][1] == name


def test_the_one_shot_jobs_apply_topics_and_migrations(services: dict[str, dict[str, Any]]) -> None:
    jobs = {tuple(s["command"][1:]): name for name, s in _agl_services(services).items() if s.get("restart") == "no"}
    assert ("topics", "apply") in jobs
    assert ("clickhouse", "migrate") in jobs
    topics_job = jobs[("topics", "apply")]
    # Replication is capped at the brokers the job sees: it must wait for every one of them.
    assert services[topics_job]["depends_on"] == {
        name: {"condition": "service_healthy"} for name in _kafka_services(services)
    }
    for name in STORE_ROLES | TRAINING_ROLES:
        assert services[name]["depends_on"][topics_job] == {"condition": "service_completed_successfully"}
    migrate_job = jobs[("clickhouse", "migrate")]
    assert services["gateway"]["depends_on"][migrate_job] == {"condition": "service_completed_successfully"}


def test_every_agl_variable_is_a_setting(services: dict[str, dict[str, Any]], cli: Any) -> None:
    settings = {f"AGL_{name.upper()}" for name in Settings.model_fields}
    known = settings | {SECRETS_DIR_ENV} | _all_envvars(cli)
    # Every AGL_* word in the compose file, the Dockerfile and the entrypoint, comments included.
    for path in (COMPOSE, DOCKERFILE, ENTRYPOINT):
        used = set(re.findall(r"\bAGL_[A-Z0-9_]+", path.read_text()))
        assert used <= known, f"{path.name} names variables agl-stream does not read: {sorted(used - known)}"
    for name, service in _agl_services(services).items():
        for variable, value in _environment(service).items():
            assert variable in settings | {SECRETS_DIR_ENV}, f"{name}: {variable} is not a setting"
            assert "PASSWORD" not in variable and "TOKEN" not in variable, (
                f"{name}: {variable} is a secret: give it as a file (secrets:), not in the environment"
            )
            if variable != SECRETS_DIR_ENV:
                Settings.model_validate({variable.removeprefix("AGL_").lower(): value})  # the value is valid


def test_secrets_are_files_named_as_the_settings_read_them(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    secret_fields = {
        f"agl_{name}" for name, field in Settings.model_fields.items() if "SecretStr" in str(field.annotation)
    }
    declared = compose["secrets"]
    for name, source in declared.items():
        assert name in secret_fields, f"secret {name} is not agl_<a secret setting>"
        assert source == {"environment": name.upper()}, f"secret {name} comes from the variable {name.upper()}"
    for name, service in services.items():
        wanted = service.get("secrets") or []
        assert set(wanted) <= set(declared), f"{name}: undeclared secrets"
        if wanted and name in _agl_services(services):  # the others name their files in their own config
            assert _environment(service)[SECRETS_DIR_ENV] == "/run/secrets", f"{name}: {SECRETS_DIR_ENV}"
    assert 'exec "$@"' in ENTRYPOINT.read_text()
    assert "ENTRYPOINT" in DOCKERFILE.read_text() and "docker-entrypoint.sh" in DOCKERFILE.read_text()


def test_listeners_beyond_loopback_have_the_token(services: dict[str, dict[str, Any]]) -> None:
    """auth.listener_token: a listener bound beyond loopback refuses to start without a token."""
    loopback = {"127.0.0.1", "localhost", "::1"}
    for name, service in _agl_services(services).items():
        argv = [str(a) for a in service["command"]]
        hosts = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--host"}
        env = _environment(service)
        if "AGL_GATEWAY_HOST" in env and argv[1] == "gateway":
            hosts.add(env["AGL_GATEWAY_HOST"])
        if hosts - loopback:
            assert "agl_api_token" in (service.get("secrets") or []), f"{name} listens beyond loopback: needs the token"
    # Containers reach the gateway by its service name: it must answer to it.
    assert "gateway" in _environment(services["gateway"])["AGL_ALLOWED_HOSTS"].split(",")
    for name, service in _agl_services(services).items():
        url = _environment(service).get("AGL_GATEWAY_URL")
        if url is not None:
            assert url == "http://gateway:8642", name
            assert "agl_api_token" in (service.get("secrets") or []), f"{name} calls the gateway: needs the token"


def test_topic_prefix_and_topic_names_match_the_declarations(services: dict[str, dict[str, Any]]) -> None:
    prefixes = {_environment(s).get("AGL_TOPIC_PREFIX") for s in _agl_services(services).values()}
    prefixes.discard(None)
    assert prefixes == {Settings().topic_prefix}, "one topic prefix, the default the README's commands use"
    declared = {spec.name for spec in load_topic_specs()}
    prefix = Settings().topic_prefix
    named = set(re.findall(rf"\b{re.escape(prefix)}\.([a-z][a-z0-9-]*)", COMPOSE.read_text()))
    assert named, "the file names the topics its scaling notes are about"
    assert named <= declared, f"undeclared topics named: {sorted(named - declared)}"


def test_scaling_notes_match_the_partition_counts() -> None:
    """The header says each consumer group scales to 4 instances: the declared partition counts."""
    specs = {spec.name: spec for spec in load_topic_specs()}
    match = re.search(r"partition count of their input, (\d+) as declared", COMPOSE.read_text())
    assert match is not None
    for topic in ("rollouts", "spans", "triplets"):
        assert specs[topic].partitions == int(match.group(1)), topic


def test_kafka_is_three_combined_nodes_of_the_local_brokers_version(services: dict[str, dict[str, Any]]) -> None:
    kafka = _kafka_services(services)
    assert len(kafka) == KAFKA_NODES
    assert {s["image"] for s in kafka.values()} == {f"apache/kafka:{KAFKA_VERSION}"}
    envs = {name: _environment(s) for name, s in kafka.items()}
    node_ids = sorted(int(env["KAFKA_NODE_ID"]) for env in envs.values())
    assert node_ids == list(range(1, KAFKA_NODES + 1))
    voters = {f"{env['KAFKA_NODE_ID']}@{name}:9093" for name, env in envs.items()}
    for name, env in envs.items():
        assert set(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert f"INTERNAL://{name}:19092" in env["KAFKA_ADVERTISED_LISTENERS"]
        assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert len({env["CLUSTER_ID"] for env in envs.values()}) == 1
    bootstrap = {
        _environment(s)["AGL_KAFKA_BOOTSTRAP"]
        for s in _agl_services(services).values()
        if s["command"][1:2] != ["clickhouse"]
    }
    assert bootstrap == {",".join(f"{name}:19092" for name in sorted(kafka))}


def test_kafka_version_matches_the_local_brokers_pom() -> None:
    pom = (ROOT / "infra" / "kafka" / "pom.xml").read_text()
    assert f"<kafka.version>{KAFKA_VERSION}</kafka.version>" in pom


def test_replication_three_and_min_isr_two_everywhere(services: dict[str, dict[str, Any]]) -> None:
    for name, service in _kafka_services(services).items():
        env = _environment(service)
        for key in (
            "KAFKA_DEFAULT_REPLICATION_FACTOR",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
        ):
            assert env[key] == str(KAFKA_NODES), f"{name}: {key}"
        for key in (
            "KAFKA_MIN_INSYNC_REPLICAS",
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR",
        ):
            assert env[key] == "2", f"{name}: {key}"
    # agl-stream's own topics, as `topics apply` creates them on these three brokers.
    for spec in load_topic_specs():
        replication = spec.replication_for(KAFKA_NODES)
        assert replication == KAFKA_NODES, spec.name
        assert spec.configs_for(replication)["min.insync.replicas"] == "2", spec.name


def test_every_dependency_exists(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    volumes = set(compose.get("volumes") or {})
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        assert set(depends) <= set(services), f"{name} depends on unknown services: {set(depends) - set(services)}"
        assert name not in depends, f"{name} depends on itself"
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.removeprefix("service:") in services, name
            assert "ports" not in service, f"{name} shares another's network: publish ports there"
        for volume in service.get("volumes") or []:
            source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: undeclared volume {source}"
        profiles = set(service.get("profiles") or [])
        for dependency in depends:
            # A service outside a profile cannot need one that only runs under it.
            assert set(services[dependency].get("profiles") or []) <= profiles, f"{name} -> {dependency}"


def test_ports_bind_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = 0
    for name, service in services.items():
        for port in service.get("ports") or []:
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
            published += 1
    assert published >= KAFKA_NODES + 2  # the brokers, ClickHouse and the gateway


def test_the_image_installs_the_package_from_the_checkout() -> None:
    text = DOCKERFILE.read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    # Everything the wheel's force-include needs is copied (else the build fails).
    for path in ("pyproject.toml", "README.md", "agl_stream", "processors", "producers", "consumers", "schemas"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path
    for path in ("topics", "infra", "docs/sql.md"):
        assert f"COPY {path} {path}" in text, path
    assert "USER agl" in text
