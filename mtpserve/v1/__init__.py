"""Generated protobuf/gRPC stubs of the mtpserve.v1 API (source: proto/mtpserve/v1/*.proto).

Regenerate with `python tools/gen_proto.py`; do not edit the *_pb2* files by hand.
"""
