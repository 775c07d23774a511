"""tierguard inside other engines: connectors that give them tierguard's KV tiers and contract.

vllm/   `TierguardConnector`, a vLLM v1 KV connector (docs/vllm-connector.md)
"""
