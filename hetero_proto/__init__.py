"""Generated protobuf and gRPC stubs (see protos/generate.py). Do not edit *_pb2* files."""
