from .attention import ReferenceAttentionKernel, paged_attention_reference, write_kv_reference

__all__ = ["ReferenceAttentionKernel", "paged_attention_reference", "write_kv_reference"]
