"""`python -m vllm_servicer`: the standalone launcher (`vllm_servicer.serve`).

vLLM spawns its engine processes, and each imports this module again (as
`__mp_main__`): the launcher is imported when run here, not in each of them.
"""

if __name__ == "__main__":
    from vllm_servicer.serve import main

    main()
