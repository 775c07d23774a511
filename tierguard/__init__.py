"""tierguard: LLM inference that borrows host RAM and NVMe without letting p99 collapse."""

__version__ = "0.1.0"
