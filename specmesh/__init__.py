"""Generated protobuf/gRPC code for the specmesh API (see protos/). Do not edit."""
