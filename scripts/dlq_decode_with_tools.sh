#!/usr/bin/env bash
# Decode one dead letter with tools that are not agl-stream: kcat reads the record's bytes,
# Apache Avro's avro-tools (fragtojson) decodes them with the .avsc files
# `agl-stream schemas export --dir DIR` wrote; then the same for the record it rejected.
# docs/dlq.md explains each step.
#
#   scripts/dlq_decode_with_tools.sh BOOTSTRAP TOPIC PARTITION OFFSET SCHEMA_DIR AVRO_TOOLS_JAR
#
# e.g. scripts/dlq_decode_with_tools.sh localhost:9092 agl.dlq 2 17 /tmp/avsc avro-tools-1.11.4.jar
# Prints the dead letter as JSON, then the rejected record as JSON (or says it is no Avro).
set -euo pipefail
bootstrap=$1 topic=$2 partition=$3 offset=$4 schemas=$5 jar=$6
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. The record's value, as bytes (-f '%s': the value only, no delimiter).
kcat -C -b "$bootstrap" -t "$topic" -p "$partition" -o "$offset" -c 1 -e -q -f '%s' > "$work/letter.bin"

decode() {  # FILE: the single-object header (10 bytes) names the schema file; the rest is the datum
  local header
  header=$(od -An -tx1 -N10 "$1" | tr -d ' \n')
  if [[ ${header:0:4} != c301 || ! -f "$schemas/by-header/$header.avsc" ]]; then
    echo "not an Avro single-object record of a known schema (first bytes: $header)" >&2
    return 1
  fi
  tail -c +11 "$1" > "$1.body"
  java -jar "$jar" fragtojson --schema-file "$schemas/by-header/$header.avsc" "$1.body" 2>/dev/null
}

decode "$work/letter.bin" | tee "$work/letter.json"
# 2. The rejected record: avro-tools writes Avro bytes as a JSON string of code points 0-255.
python3 -c 'import json, sys; sys.stdout.buffer.write(json.load(open(sys.argv[1]))["value"].encode("latin-1"))' \
  "$work/letter.json" > "$work/original.bin"
decode "$work/original.bin"
