"""`python -m vllm_servicer`: the standalone launcher (`vllm_servicer.serve`)."""

from .serve import main

if __name__ == "__main__":
    main()
