"""The descriptor pool that holds this package's protocol definitions.

Kept apart from protobuf's default pool so the reference stubs, which register
the same full names there, can be imported in the same process.
"""

from google.protobuf import descriptor_pool, struct_pb2

POOL = descriptor_pool.DescriptorPool()
# The well-known types the protocol files import (vLLM's Inference: Struct).
POOL.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
