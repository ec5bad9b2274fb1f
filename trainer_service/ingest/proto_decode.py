"""Registering servicers so that a request that does not parse gets INVALID_ARGUMENT naming the field.

grpcio answers a request its deserializer rejects with INTERNAL ("Exception deserializing request!"), which
tells the sender nothing. Here each service is registered from its descriptor with a deserializer that, on
failure, parses the bytes again with a twin of the message whose `string` fields are `bytes` (same wire format)
and finds the field that is not UTF-8 (e.g. `prompts[2].tags[0]`); the method then answers INVALID_ARGUMENT
with that path. Nothing is unpickled; protobuf is the only format on the wire.
"""

from __future__ import annotations

import functools

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError


class BadRequest:
    """Stands in for a request that did not parse; `message` names the field."""

    def __init__(self, message: str):
        self.message = message


@functools.lru_cache(maxsize=None)
def _twin_pool(file_name: str) -> descriptor_pool.DescriptorPool:
    """A private pool holding `file_name` (and what it imports) with every string field turned into bytes."""
    pool = descriptor_pool.DescriptorPool()
    default = descriptor_pool.Default()

    def add(name: str) -> None:
        try:
            pool.FindFileByName(name)
            return
        except KeyError:
            pass
        proto = descriptor_pb2.FileDescriptorProto()
        default.FindFileByName(name).CopyToProto(proto)
        for dep in proto.dependency:
            add(dep)

        def relax(messages) -> None:
            for m in messages:
                m.options.map_entry = False  # a map becomes a repeated {key, value}: bytes keys are not allowed
                for f in m.field:
                    if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                        f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                relax(m.nested_type)
        relax(proto.message_type)
        pool.Add(proto)
    add(file_name)
    return pool


def _bad_utf8(msg, original, path: str) -> str | None:
    """Path of the first field that is a string in `original` (the real descriptor) but not UTF-8 in `msg` (the
    twin), or None."""
    for field, value in msg.ListFields():
        real = original.fields_by_name[field.name]
        where = f"{path}.{field.name}" if path else field.name
        if real.message_type is not None and real.message_type.GetOptions().map_entry:
            key_t, value_f = real.message_type.fields_by_name["key"].type, real.message_type.fields_by_name["value"]
            for k, v in ((entry.key, entry.value) for entry in value):  # the twin holds entries, not a map
                if key_t == FieldDescriptor.TYPE_STRING and _not_utf8(k):
                    return f"{where} (a key)"
                if value_f.type == FieldDescriptor.TYPE_STRING and _not_utf8(v):
                    return f"{where}[{k!r}]"
                if value_f.message_type is not None:
                    found = _bad_utf8(v, value_f.message_type, f"{where}[{k!r}]")
                    if found:
                        return found
            continue
        repeated = field.is_repeated
        for i, item in enumerate(value if repeated else [value]):
            at = f"{where}[{i}]" if repeated else where
            if real.message_type is not None:
                found = _bad_utf8(item, real.message_type, at)
                if found:
                    return found
            elif real.type == FieldDescriptor.TYPE_STRING and _not_utf8(item):
                return at
    return None


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def explain(message_cls, data: bytes) -> str:
    """Why `data` is not a valid `message_cls`, naming the field when a string is not UTF-8."""
    descriptor = message_cls.DESCRIPTOR
    try:
        twin_desc = _twin_pool(descriptor.file.name).FindMessageTypeByName(descriptor.full_name)
        twin = message_factory.GetMessageClass(twin_desc).FromString(data)
    except (DecodeError, KeyError, TypeError):
        return f"request is not a valid {descriptor.name} (malformed protobuf)"
    path = _bad_utf8(twin, descriptor, "")
    if path is None:
        return f"request is not a valid {descriptor.name} (malformed protobuf)"
    return f"{path}: not valid UTF-8 (string fields must be UTF-8 text)"


def _parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            return BadRequest(explain(message_cls, data))
    return parse


def _guard_unary(behavior):
    def handle(request, context):
        if isinstance(request, BadRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)
    return handle


def _guard_stream(behavior):
    def handle(request_iterator, context):
        def checked():
            for request in request_iterator:
                if isinstance(request, BadRequest):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                yield request
        return behavior(checked(), context)
    return handle


def add_service(server: grpc.Server, servicer, service_full_name: str) -> None:
    """Register `servicer` for the service `service_full_name` (its *_pb2 module must be imported)."""
    service = descriptor_pool.Default().FindServiceByName(service_full_name)
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        kind = (method.client_streaming, method.server_streaming)
        guard = _guard_stream if method.client_streaming else _guard_unary
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[kind]
        handlers[method.name] = make(guard(behavior), request_deserializer=_parser(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_full_name, handlers),))
