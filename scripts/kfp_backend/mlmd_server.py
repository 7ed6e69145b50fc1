"""An ML Metadata (MLMD) gRPC server for KFP 2.17.0's driver and launcher, without MLMD's C++ server binary.

    python scripts/kfp_backend/mlmd_server.py --port 8080 [--sqlite FILE | --postgres HOST:PORT:DB:USER]

KFP 2.17.0's driver and launcher record executions, artifacts and contexts through the gRPC service
``ml_metadata.MetadataStoreService`` (KFP's manifests run ``ml_metadata_store_server`` 1.14.0 for it).  That
server is C++ built with Bazel, whose toolchain and downloads this machine cannot have.  The PyPI wheel of
``ml-metadata`` (1.17.1 for CPython 3.11) carries the same C++ store as a pybind11 extension, whose functions take
and return each RPC's serialized request and response, the way the wheel's own ``MetadataStore._pywrap_cc_call``
calls them.  So this server hands each call's bytes to the extension's function of the same name, unparsed, and
maps its status code onto gRPC's (MLMD's codes are absl codes, numerically the same as gRPC's).

Calls run one at a time (one store connection, as the C++ server's per-request lock would give).  Methods the
extension lacks answer UNIMPLEMENTED (1.17.1 lacks GetLineageGraph, GetParentContextsByContexts,
GetChildrenContextsByContexts); the names are printed at start.

Runs in a virtual environment of its own (ml-metadata pins protobuf < 5, the project's venv has a newer one):
``python3 -m venv V && V/bin/pip install ml-metadata==1.17.1``.
"""

from __future__ import annotations

import argparse
import threading
from concurrent import futures

import grpc
from ml_metadata.metadata_store.pywrap.metadata_store_extension import metadata_store as store_ext
from ml_metadata.proto import metadata_store_pb2, metadata_store_service_pb2

SERVICE = metadata_store_service_pb2.DESCRIPTOR.services_by_name["MetadataStoreService"]


def connection_config(args: argparse.Namespace) -> metadata_store_pb2.ConnectionConfig:
    config = metadata_store_pb2.ConnectionConfig()
    if args.postgres:
        host, port, dbname, user = args.postgres.split(":")
        config.postgresql.host, config.postgresql.port = host, port
        config.postgresql.dbname, config.postgresql.user = dbname, user
    else:
        config.sqlite.filename_uri = args.sqlite
        config.sqlite.connection_mode = metadata_store_pb2.SqliteMetadataSourceConfig.READWRITE_OPENCREATE
    return config


def handlers(store, lock: threading.Lock) -> tuple[grpc.GenericRpcHandler, list[str]]:
    """One unary handler per RPC of the service, passing serialized bytes through the extension."""

    def make(fn):
        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            with lock:
                response, error, code = fn(store, request)
            if code != 0:
                context.abort(_STATUS.get(code, grpc.StatusCode.UNKNOWN), error.decode("utf-8", "replace"))
            return response

        return grpc.unary_unary_rpc_method_handler(call)  # no (de)serializers: bytes in, bytes out

    table, missing = {}, []
    for method in SERVICE.methods:
        fn = getattr(store_ext, method.name, None)
        if fn is None:
            missing.append(method.name)
        else:
            table[method.name] = make(fn)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, table), missing


_STATUS = {c.value[0]: c for c in grpc.StatusCode}  # absl status codes are gRPC's numbers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8080, help="gRPC port (KFP's default: 8080)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--sqlite", default="/tmp/mlmd.sqlite", help="SQLite file of the store (default)")
    p.add_argument("--postgres", help="HOST:PORT:DB:USER of a PostgreSQL database instead of SQLite")
    args = p.parse_args(argv)
    migration = metadata_store_pb2.MigrationOptions(enable_upgrade_migration=True)
    store = store_ext.CreateMetadataStore(connection_config(args).SerializeToString(), migration.SerializeToString())
    handler, missing = handlers(store, threading.Lock())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"mlmd-server: {SERVICE.full_name} on {args.host}:{args.port}; unimplemented: {', '.join(missing) or 'none'}",
          flush=True)  # fmt: skip
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
