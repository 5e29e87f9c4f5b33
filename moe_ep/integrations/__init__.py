"""What ties moe_ep's layers to other people's code, one module per framework.

    transformers   swap_moe: EPMoE into the sparse MoE blocks of a transformers model
    vllm           a prepare/finalize over EPAllToAll for vLLM's modular MoE kernel, and its plugin

``vllm`` imports vLLM: import it only where vLLM is installed.
"""
