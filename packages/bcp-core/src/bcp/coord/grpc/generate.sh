#!/usr/bin/env bash
# Regenerates tree_pb2.py / tree_pb2_grpc.py from tree.proto with grpcio-tools (bcp-core's [test]
# extra). The stubs are committed, so installing bcp needs only grpcio and protobuf at run time.
set -euo pipefail
src="$(cd "$(dirname "$0")/../../.." && pwd)"  # packages/bcp-core/src: imports become bcp.coord.grpc.*
python="${PYTHON:-python}"
"$python" -m grpc_tools.protoc -I "$src" --python_out="$src" --grpc_python_out="$src" \
    "$src/bcp/coord/grpc/tree.proto"
