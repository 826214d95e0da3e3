#!/bin/sh
# Entrypoint of the agl-stream image (infra/Dockerfile): check the secret files, then run the
# command (`agl-stream <role> ...`).
#
# docker compose writes each secret to /run/secrets/<name> from a variable of the shell that
# ran it; an unset variable gives an empty file, and an empty API token must never be what a
# listener accepts. So a role with an empty (or blank) secret file in AGL_SECRETS_DIR refuses
# to start and says which.
set -eu

if [ -n "${AGL_SECRETS_DIR:-}" ] && [ -d "$AGL_SECRETS_DIR" ]; then
    for file in "$AGL_SECRETS_DIR"/*; do
        [ -f "$file" ] || continue
        if [ -z "$(tr -d '[:space:]' < "$file")" ]; then
            name=$(basename "$file")
            echo "agl-entrypoint: the secret $name is empty: export $(echo "$name" | tr '[:lower:]' '[:upper:]') in the shell that runs docker compose, then recreate this service" >&2
            exit 78
        fi
    done
fi

exec "$@"
