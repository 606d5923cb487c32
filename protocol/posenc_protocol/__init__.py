"""The posenc protocol, shared by the SDK (``posenc``) and the server (``posenc_server``).

``posenc_protocol.v1`` holds the stubs generated from ``proto/posenc/v1/posenc.proto`` (the
proto package ``posenc.v1``); :mod:`posenc_protocol.descriptors` names what the descriptors
hold (table kinds, parameters, enum values, field types); :mod:`posenc_protocol.limits`
holds a server's default limits; :mod:`posenc_protocol.wire` encodes and decodes a
response's payload; :mod:`posenc_protocol.regions` writes and reads the messages of a
server's region socket (shared memory for clients on its machine);
:mod:`posenc_protocol.numbers` reads integers as people type them;
:mod:`posenc_protocol.stats` holds the cache counters a server reports. It imports neither
the SDK nor the server: both import it.
"""
