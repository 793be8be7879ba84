"""The protocol's messages and vLLM's objects, both ways: no grpc here."""
