"""The descriptor pool that holds this package's protocol definitions.

Kept apart from protobuf's default pool so the reference stubs, which register
the same full names there, can be imported in the same process.
"""

from google.protobuf import descriptor_pool, duration_pb2, struct_pb2

POOL = descriptor_pool.DescriptorPool()
# The well-known types the protocol files import (vLLM's Inference: Struct;
# ORCA's OpenRcaService: Duration).
POOL.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
POOL.AddSerializedFile(duration_pb2.DESCRIPTOR.serialized_pb)
