"""What ties moe_ep's layers to other people's code, one module per framework.

    transformers   swap_moe: EPMoE into the sparse MoE blocks of a transformers model
    vllm           a prepare/finalize over EPAllToAll for vLLM's modular MoE kernel, and its plugin
    sglang         a token dispatcher over EPAllToAll for SGLang's MoE layers, and its plugin

``vllm`` and ``sglang`` import their engine: import them only where it is installed.
"""
