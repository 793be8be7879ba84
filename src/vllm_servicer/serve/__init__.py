"""The standalone launcher: serve one engine's model over gRPC, on its own.

`main()` is `python -m vllm_servicer` and the `vllm-servicer` command.
"""

from .cli import main

__all__ = ["main"]
