#!/usr/bin/env bash
# Regenerates the protobuf/gRPC stubs beside proto/scoring.proto (or into DIR if given).
# The virtual include path makes the stubs import "from proctor.proto import scoring_pb2".
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-proto}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m grpc_tools.protoc -Iproctor/proto=proto \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  proctor/proto/scoring.proto
mkdir -p "$dest"
cp "$tmp"/proctor/proto/scoring_pb2.py "$tmp"/proctor/proto/scoring_pb2.pyi "$tmp"/proctor/proto/scoring_pb2_grpc.py "$dest"/
